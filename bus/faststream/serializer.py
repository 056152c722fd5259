"""`BusSerializer`: msgspec for handlers that name a `msgspec.Struct`, pydantic for the rest."""

from __future__ import annotations

import typing
from typing import TYPE_CHECKING, Any

import msgspec
from fast_depends.msgspec import MsgSpecSerializer
from fast_depends.pydantic import PydanticSerializer

if TYPE_CHECKING:
    from fast_depends.library.serializer import OptionItem, Serializer


def _names_struct(annotation: Any) -> bool:
    """Whether a type annotation is, or contains, a msgspec.Struct."""
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        return True
    return any(_names_struct(a) for a in typing.get_args(annotation))


class BusSerializer:
    """The default serializer of a BusBroker: a handler with a `msgspec.Struct` argument (or return
    type) is decoded by msgspec, any other by pydantic as FastStream decodes by default."""

    def __init__(self) -> None:
        self.pydantic = PydanticSerializer(use_fastdepends_errors=False)
        self.msgspec = MsgSpecSerializer(use_fastdepends_errors=False)

    def __call__(self, *, name: str, options: list[OptionItem], response_type: Any) -> Serializer:
        if any(_names_struct(o.field_type) for o in options) or _names_struct(response_type):
            return self.msgspec(name=name, options=options, response_type=response_type)
        return self.pydantic(name=name, options=options, response_type=response_type)

    @staticmethod
    def encode(message: Any) -> bytes:
        if isinstance(message, msgspec.Struct):
            return msgspec.json.encode(message)
        return PydanticSerializer.encode(message)
