"""Write the Triton model repository for a deployment YAML (what `tokenrouter serve` does before it starts
tritonserver), for containers whose entrypoint is plain `tritonserver --model-repository /models`.

    python3 /opt/tokenrouter/docker/make_repository.py /deploy/deployment.yaml /models
    python3 /opt/tokenrouter/docker/make_repository.py --peer /deploy/deployment.yaml /models   # a peer node

The repository holds one folder per model (`tokenrouter` router + one subserver per model of the
deployment), each pointing at the YAML by a path relative to itself: the YAML (and the weights it names)
must be at the same absolute paths in the server container as here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenrouter.config import ConfigError, load_config
from tokenrouter.serving.repository import write_repository


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="deployment YAML")
    p.add_argument("out", nargs="?", default="/models", help="model repository folder (default /models)")
    p.add_argument("--peer", action="store_true",
                   help="the repository of a peer node: the deployment's models that name a url, no router")
    args = p.parse_args(argv)
    try:
        load_config(args.config)  # fail here, with the config's own message, not later inside tritonserver
        repo = write_repository(args.config, args.out, peer=args.peer)
    except (ConfigError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    models = sorted(d.name for d in Path(repo).iterdir() if (d / "config.pbtxt").is_file())
    print(f"wrote model repository {repo} for {args.config}: {', '.join(models)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
