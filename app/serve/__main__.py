"""`python -m app.serve ...`: start the serving app (app/serve/deployment.py says how)."""

import sys

from app.serve.deployment import main

sys.exit(main())
