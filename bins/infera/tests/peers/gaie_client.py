"""An independent gRPC client of `infera gaie`, built from Envoy's own ext_proc protos (PyPI
`xds-protos`) and gRPC's health protos (`grpcio-health-checking`) on `grpcio`: what an Envoy
gateway and a Kubernetes gRPC probe send, field for field.

Line protocol (the Rust test drives it): after printing `{"ready": true}`, it reads one JSON
object per stdin line and prints one JSON line per request:

  {"op": "process", "target": "127.0.0.1:9002", "tls": false, "messages": [M, ...]}
      opens one Process stream, sends every M (a ProcessingRequest in protobuf's JSON mapping,
      bytes fields as text in "body_text" for convenience) and closes its side; prints
      {"responses": [R, ...]} (each ProcessingResponse in protobuf's JSON mapping, bytes fields
      base64 as the mapping writes them) or {"error": {"code": NAME, "details": TEXT}}.
  {"op": "health", "target": ..., "tls": bool, "service": NAME}
      prints {"status": "SERVING"} or {"error": {...}}.

TLS: the picker's certificate is self-signed, so it is fetched first and trusted as the root,
with the name it is issued for (`infera-epp`).
"""

import base64
import json
import ssl
import sys

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEADLINE_S = 60


def channel(target, tls):
    if not tls:
        return grpc.insecure_channel(target)
    host, port = target.rsplit(":", 1)
    pem = ssl.get_server_certificate((host, int(port)), timeout=DEADLINE_S)
    credentials = grpc.ssl_channel_credentials(root_certificates=pem.encode())
    return grpc.secure_channel(
        target, credentials, options=[("grpc.ssl_target_name_override", "infera-epp")]
    )


def request(message):
    for phase in ("request_body", "response_body"):
        body = message.get(phase)
        if body is not None and "body_text" in body:
            body["body"] = base64.b64encode(body.pop("body_text").encode()).decode()
    return json_format.ParseDict(message, pb.ProcessingRequest())


def process(line):
    messages = [request(m) for m in line["messages"]]
    with channel(line["target"], line.get("tls", False)) as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        answers = stub.Process(iter(messages), timeout=DEADLINE_S)
        return {
            "responses": [
                json_format.MessageToDict(a, preserving_proto_field_name=True) for a in answers
            ]
        }


def health(line):
    with channel(line["target"], line.get("tls", False)) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        answer = stub.Check(
            health_pb2.HealthCheckRequest(service=line["service"]), timeout=DEADLINE_S
        )
        return {"status": health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)}


def main():
    print(json.dumps({"ready": True}), flush=True)
    for raw in sys.stdin:
        line = json.loads(raw)
        try:
            out = process(line) if line["op"] == "process" else health(line)
        except grpc.RpcError as e:
            out = {"error": {"code": e.code().name, "details": e.details()}}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
