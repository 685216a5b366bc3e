"""OpenAI-compatible serving of trained adapters: `python -m app.serve` (app/serve/deployment.py)."""
