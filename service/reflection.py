"""Server reflection, both versions: ``grpc.reflection.v1`` (asked for first by newer
clients: grpcurl >= 1.9, buf curl, Postman) and ``grpc.reflection.v1alpha`` (older ones).

grpcio-reflection ships only v1alpha. The two protocols have the same messages, field for
field, under another package, so the v1alpha servicer answers v1 calls as they are: the
bytes of a v1 request parse as a v1alpha request and vice versa. A v1 copy of the
reflection descriptor is added to the pool so that ``describe grpc.reflection.v1...``
works too.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1ALPHA_SERVICE_NAME: str = reflection.SERVICE_NAME
V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def _add_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    """Put a v1 copy of the v1alpha reflection file into ``pool`` (once)."""
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old, new = f".{proto.package}.", f".{V1_PACKAGE}."
    proto.name, proto.package = _V1_FILE, V1_PACKAGE
    for message in proto.message_type:
        for field in message.field:
            if field.type_name.startswith(old):
                field.type_name = new + field.type_name[len(old):]
    for service in proto.service:
        for method in service.method:
            method.input_type = new + method.input_type[len(old):]
            method.output_type = new + method.output_type[len(old):]
    pool.Add(proto)


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serve reflection v1 and v1alpha on ``server`` for ``service_names`` (plus both
    reflection services themselves)."""
    names = tuple(dict.fromkeys((*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)))
    _add_v1_descriptor(descriptor_pool.Default())
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString),
    })
    server.add_generic_rpc_handlers((v1,))
