"""`python -m tokenrouter.serving.openai`: serve the OpenAI-compatible front end."""

import sys

from tokenrouter.serving.openai.http_server import main

sys.exit(main())
