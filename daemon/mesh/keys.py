"""The mesh's CURVE key files: made once per node, the secret readable by the daemon's user alone.

``mmfeatd --gen-keys DIR`` writes ``DIR/mesh.secret`` (mode 0600, never overwritten) and
``DIR/mesh.public``; the public key goes into every other node's ``peers`` list. Keys are Z85 text,
as ZeroMQ prints them.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Mapping, Optional

import zmq
from zmq.utils import z85

SECRET_FILE = "mesh.secret"
PUBLIC_FILE = "mesh.public"
Z85_KEY_CHARS = 40


class KeyFileError(Exception):
    """A key file that cannot be used; the message says which and what to do."""


def generate(directory: Path) -> tuple[Path, Path]:
    """Write a new keypair into ``directory``; refuses to replace an existing secret."""
    directory.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.curve_keypair()
    secret_path, public_path = directory / SECRET_FILE, directory / PUBLIC_FILE
    try:
        fd = os.open(secret_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise KeyFileError(f"{secret_path} exists; move it away first if you mean to replace this node's key") from None
    with os.fdopen(fd, "w") as f:
        f.write(secret.decode() + "\n")
    public_path.write_text(public.decode() + "\n")
    return public_path, secret_path


def credential(environ: Mapping[str, str]) -> Optional[Path]:
    """The secret key systemd handed this process in $CREDENTIALS_DIRECTORY, if it handed one."""
    directory = environ.get("CREDENTIALS_DIRECTORY")
    if not directory:
        return None
    path = Path(directory) / SECRET_FILE  # LoadCredential=mesh.secret:PATH (deploy/mmfeatd-mesh.conf)
    return path if path.is_file() else None


def load_secret(path: Path) -> tuple[bytes, bytes]:
    """(public, secret) from a secret key file that only its owner can read."""
    try:
        st = path.stat()
        text = path.read_text().strip()
    except OSError as exc:
        if isinstance(exc, PermissionError):
            raise KeyFileError(f"cannot read the mesh secret key {path}: {exc.strerror}; under systemd "
                               "install deploy/mmfeatd-mesh.conf as the unit's drop-in, which hands the daemon "
                               "a copy") from None
        raise KeyFileError(f"cannot read the mesh secret key {path}: {exc.strerror}; make one with "
                           "mmfeatd --gen-keys DIR") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(f"the mesh secret key {path} is readable by others (mode {st.st_mode & 0o777:04o}); "
                           "chmod 0400 it (the daemon's user alone may read it)")
    secret = text.encode()
    try:
        parse_key(text)
        public = zmq.curve_public(secret)
    except (KeyFileError, zmq.ZMQError, ValueError):
        raise KeyFileError(f"{path} does not hold a Z85 CURVE secret key ({Z85_KEY_CHARS} characters)") from None
    return public, secret


def parse_key(text: str) -> bytes:
    """A Z85 key as ZeroMQ wants it; KeyFileError unless it is one."""
    if len(text) != Z85_KEY_CHARS:
        raise KeyFileError(f"a Z85 CURVE key has {Z85_KEY_CHARS} characters, not {len(text)}")
    try:
        z85.decode(text)
    except Exception:
        raise KeyFileError("not a Z85 key") from None
    return text.encode()
