"""``python -m infera.gaie`` runs ``infera gaie``, the Gateway API Inference Extension's
endpoint picker."""
