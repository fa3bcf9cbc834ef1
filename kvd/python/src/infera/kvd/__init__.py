"""``python -m infera.kvd`` runs ``infera kvd``, the KV-cache daemon."""
