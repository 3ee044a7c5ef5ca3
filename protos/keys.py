"""Feature keys and their namespaces (SPEC.md, section 3, "Keys"): made and checked here, so that the
client and the daemon agree on what a key is.

A key is ``<namespace>/<name>``: the namespace is 16 lowercase hex digits of a hash of what makes two
features with the same name different (the framework and its version, the model, the dtype, a prefix
of the user's), so that two models served through one daemon never read each other's features.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Any

from .errors import ErrorCode, MmfeatError

MAX_KEY_BYTES = 256  # utf-8 bytes of a whole key, namespace included
MAX_LOOKUP_KEYS = 128  # keys in one lookup_key request (has_many): 128 of the longest fit a request frame
NAMESPACE_CHARS = 16
_HEX = frozenset("0123456789abcdef")


def key_problem(key: Any) -> str:
    """Why ``key`` is not a key; "" when it is one."""
    if type(key) is not str:
        return f"a key is a str, not {type(key).__name__}"
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        # A lone surrogate: no frame can carry it, and no other process could spell the key.
        return f"key {key[:80]!r} is not valid UTF-8 (it holds a lone surrogate): make names of text or hex digits"
    if size > MAX_KEY_BYTES:
        return (f"key is {size} bytes of utf-8, over the {MAX_KEY_BYTES} a key may have: hash a longer "
                "identifier into the name")
    ns, sep, name = key.partition("/")
    if not sep or len(ns) != NAMESPACE_CHARS or not set(ns) <= _HEX or not name:
        return (f"key {key[:80]!r} is not '<namespace>/<name>' with a namespace of {NAMESPACE_CHARS} lowercase hex "
                "digits and a non-empty name: make keys with Namespace(...).key(name)")
    return ""


def check_key(key: Any) -> str:
    """``key`` itself, or BAD_REQUEST saying what is wrong with it."""
    problem = key_problem(key)
    if problem:
        raise MmfeatError(ErrorCode.BAD_REQUEST, problem)
    return key


def namespace_of(key: str) -> str:
    """The namespace part of a checked key."""
    return key[:NAMESPACE_CHARS]


def check_keys(keys: Any) -> list[str]:
    """A list of 1 to MAX_LOOKUP_KEYS keys, each checked; BAD_REQUEST or TOO_LARGE otherwise."""
    if not isinstance(keys, (list, tuple)):
        raise MmfeatError(ErrorCode.BAD_REQUEST, f"keys must be a list of str, not {type(keys).__name__}")
    if len(keys) > MAX_LOOKUP_KEYS:
        raise MmfeatError(ErrorCode.TOO_LARGE, f"{len(keys)} keys in one lookup, over the {MAX_LOOKUP_KEYS} one "
                          "request may carry: split the list")
    return [check_key(k) for k in keys]


@dataclass(frozen=True)
class Namespace:
    """Where a server's keys live: two servers whose fields differ never share a key. ``id`` is 16 hex
    digits of a SHA-256 of the fields."""

    framework: str
    version: str
    model: str
    dtype: str
    prefix: str = ""

    def __post_init__(self) -> None:
        for name in ("framework", "version", "model", "dtype", "prefix"):
            if type(getattr(self, name)) is not str:
                raise TypeError(f"Namespace.{name} must be a str, not {type(getattr(self, name)).__name__}")
            if "\0" in getattr(self, name):
                # The id hashes the fields joined by NUL: a NUL inside one would let two namespaces share it.
                raise ValueError(f"Namespace.{name} must not contain a NUL character")

    @functools.cached_property
    def id(self) -> str:  # cached: a scheduler asks for a key per item, and a SHA-256 each time costs
        # NUL-separated, and no field holds a NUL (__post_init__): two namespaces never join alike.
        fields = "\0".join((self.framework, self.version, self.model, self.dtype, self.prefix))
        return hashlib.sha256(fields.encode("utf-8", "surrogatepass")).hexdigest()[:NAMESPACE_CHARS]

    def key(self, name: str) -> str:
        """The key of feature ``name`` (an mm_hash, say) in this namespace; BAD_REQUEST if too long."""
        if type(name) is not str or not name:
            raise MmfeatError(ErrorCode.BAD_REQUEST, f"a key's name is a non-empty str, not {name!r}")
        return check_key(f"{self.id}/{name}")
