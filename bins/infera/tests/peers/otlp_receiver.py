"""An independent OTLP/gRPC trace receiver: OpenTelemetry's own protos (PyPI
`opentelemetry-proto`) served on `grpcio`, what an OpenTelemetry Collector's `otlp` receiver
accepts, field for field.

Line protocol (the Rust test reads it): first `{"port": N}` once it listens on 127.0.0.1:N,
then one JSON line per span exported to it:

  {"service": NAME, "trace_id": HEX, "span_id": HEX, "parent_span_id": HEX or "",
   "name": NAME, "kind": INT, "attributes": {KEY: VALUE}, "events": [NAME, ...]}

It runs until stdin closes.
"""

import json
import sys
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def Export(self, request, context):
        for rs in request.resource_spans:
            attrs = {a.key: value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for span in ss.spans:
                    line = {
                        "service": attrs.get("service.name"),
                        "trace_id": span.trace_id.hex(),
                        "span_id": span.span_id.hex(),
                        "parent_span_id": span.parent_span_id.hex(),
                        "name": span.name,
                        "kind": span.kind,
                        "attributes": {a.key: value(a.value) for a in span.attributes},
                        "events": [e.name for e in span.events],
                    }
                    print(json.dumps(line), flush=True)
        return trace_service_pb2.ExportTraceServiceResponse()


def main():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(json.dumps({"port": port}), flush=True)
    sys.stdin.read()
    server.stop(0)


if __name__ == "__main__":
    main()
