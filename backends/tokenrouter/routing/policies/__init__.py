"""The built-in routing policies; importing this package registers each under its `name`.

| name          | module            | rule (see each module)                                                  |
|---------------|-------------------|-------------------------------------------------------------------------|
| `always`      | `always`          | every request on one model                                              |
| `random`      | `random_policy`   | small -> large for one token with probability p                         |
| `query`       | `query`           | one model per request, chosen from the prompt                           |
| `r2r`         | `r2r`             | R2R neural router on the small model, one large token                   |
| `citer`       | `citer`           | CITER MLP score < threshold -> one large token                          |
| `rstitch`     | `rstitch`         | entropy > tau_high -> large until its entropy < tau_low                 |
| `collm`       | `collm`           | Co-LLM deferral logit -> one large token                                |
| `mixture`     | `mixture`         | next model drawn with fixed weights after every token (N models)        |
| `glimprouter` | `glimprouter`     | first-token top-k entropy of a step -> large writes the whole step      |
"""

from tokenrouter.routing.policies import (  # noqa: F401  (imported for registration)
    always,
    citer,
    collm,
    glimprouter,
    mixture,
    query,
    r2r,
    random_policy,
    rstitch,
)
