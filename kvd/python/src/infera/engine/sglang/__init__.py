"""The SGLang worker: ``python -m infera.engine.sglang`` runs ``infera worker sglang``."""
