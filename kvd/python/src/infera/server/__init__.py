"""``python -m infera.server`` runs ``infera server``, the OpenAI-compatible HTTP server and
KV-aware router."""
