"""Server reflection, used the way grpcurl uses it: with no generated code on the client.
List the services, describe a method, build the request from JSON, call it generically."""

from __future__ import annotations

import json
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha import reflection_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from tests.service.harness import ServerHarness


def call_json(harness: ServerHarness, pool: descriptor_pool.DescriptorPool, service: str,
              method: str, body: dict[str, Any]) -> dict[str, Any]:
    """``grpcurl -plaintext -d BODY target SERVICE/METHOD``."""
    descriptor = pool.FindServiceByName(service).FindMethodByName(method)
    request_cls = message_factory.GetMessageClass(descriptor.input_type)
    response_cls = message_factory.GetMessageClass(descriptor.output_type)
    request = json_format.Parse(json.dumps(body), request_cls())
    rpc = harness.channel.unary_unary(f"/{service}/{method}",
                                      request_serializer=request_cls.SerializeToString,
                                      response_deserializer=response_cls.FromString)
    response = rpc(request, timeout=10)
    return json.loads(json_format.MessageToJson(response, preserving_proto_field_name=True))


def test_grpcurl_style_list_describe_and_call(server: ServerHarness) -> None:
    database = ProtoReflectionDescriptorDatabase(server.channel)
    # grpcurl list
    assert set(database.get_services()) == {
        "model_executor.v1.Executor", "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"}
    pool = descriptor_pool.DescriptorPool(database)
    # grpcurl describe model_executor.v1.Executor / model_executor.v1.PrefillItem
    executor = pool.FindServiceByName("model_executor.v1.Executor")
    assert [m.name for m in executor.methods] == [
        "Prefill", "Decode", "Release", "Capture", "Health", "Session", "Truncate", "Fork",
        "UpdateWeights", "InitWeightTransfer", "DestroyWeightTransfer", "Sleep", "WakeUp"]
    assert executor.FindMethodByName("Decode").output_type.full_name == \
        "model_executor.v1.DecodeResponse"
    item = pool.FindMessageTypeByName("model_executor.v1.PrefillItem")
    assert [f.name for f in item.fields] == ["seq_id", "token_ids", "sample", "sampling",
                                              "every_position", "candidate_token_ids",
                                              "return_hidden_state"]

    # grpcurl -d '{...}' ... model_executor.v1.Executor/Prefill, then Decode and Release
    step = call_json(server, pool, "model_executor.v1.Executor", "Prefill", {
        "request_id": "from-json",
        "items": [{"seq_id": "refl", "token_ids": [1, 2, 3], "sample": True}]})
    assert step["step"]["phase"] == "PHASE_PREFILL"
    [output] = step["outputs"]
    assert output["seq_len"] == 3 and "token_id" in output
    step = call_json(server, pool, "model_executor.v1.Executor", "Decode", {
        "items": [{"seq_id": "refl", "token_id": output["token_id"]}]})
    assert step["outputs"][0]["seq_len"] == 4
    released = call_json(server, pool, "model_executor.v1.Executor", "Release",
                         {"seq_ids": ["refl"]})
    assert released == {"released": 1, "freed_tokens": 4}
    health = call_json(server, pool, "model_executor.v1.Executor", "Health", {})
    assert health["state"] == "SERVER_STATE_READY"
    # the standard health service, described and called the same way
    check = call_json(server, pool, "grpc.health.v1.Health", "Check",
                      {"service": "model_executor.v1.Executor"})
    assert check == {"status": "SERVING"}


def test_reflection_v1_is_served(server: ServerHarness) -> None:
    """Issue 19: newer clients (grpcurl >= 1.9, buf curl) ask for grpc.reflection.v1 first;
    only v1alpha was served. Its messages are v1alpha's, field for field."""
    rpc = server.channel.stream_stream(
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
    requests = [reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(
                    file_containing_symbol="model_executor.v1.Executor"),
                reflection_pb2.ServerReflectionRequest(
                    file_containing_symbol="grpc.reflection.v1.ServerReflection")]
    listed, executor, v1 = list(rpc(iter(requests), timeout=10))
    assert {s.name for s in listed.list_services_response.service} >= {
        "model_executor.v1.Executor", "grpc.reflection.v1.ServerReflection"}
    files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
             for raw in executor.file_descriptor_response.file_descriptor_proto]
    assert "model_executor/v1/executor.proto" in {f.name for f in files}
    [v1_file] = [descriptor_pb2.FileDescriptorProto.FromString(raw)
                 for raw in v1.file_descriptor_response.file_descriptor_proto]
    assert v1_file.package == "grpc.reflection.v1"
    assert v1_file.service[0].method[0].output_type == \
        ".grpc.reflection.v1.ServerReflectionResponse"
