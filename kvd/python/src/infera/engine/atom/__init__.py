"""The ATOM worker: ``python -m infera.engine.atom`` runs ``infera worker atom``."""
