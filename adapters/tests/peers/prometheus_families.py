"""Reads a Prometheus text exposition on stdin with the reference parser (PyPI
`prometheus-client`, the library the Python Infera exports with) and prints its families as
one JSON object: {family: {"type": TYPE, "samples": [[NAME, {LABEL: VALUE}, VALUE], ...]}}.
A line the parser refuses makes it exit non-zero with the parser's error."""

import json
import sys

from prometheus_client.parser import text_string_to_metric_families

families = {}
for family in text_string_to_metric_families(sys.stdin.read()):
    if family.name in families:
        sys.exit(f"family {family.name} appears twice")
    families[family.name] = {
        "type": family.type,
        "samples": [[s.name, s.labels, s.value] for s in family.samples],
    }
json.dump(families, sys.stdout)
