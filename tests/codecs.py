"""Payload codecs the tests configure through WFDASH["PAYLOAD_CODEC"] (the README's example)."""

from __future__ import annotations

from cryptography.fernet import Fernet

# A fixed test key; a real deployment reads its key(s) from the environment.
TEST_KEY = b"l0Yc6-9ciUeUQ6lo2mMWR8mzVvvzqdR8lkrm7a0oWeQ="


class FernetCodec:
    """Fernet (AES-128-CBC + HMAC-SHA256) encryption of every stored payload."""

    def __init__(self) -> None:
        self.fernet = Fernet(TEST_KEY)

    def encode(self, data: bytes) -> bytes:
        return self.fernet.encrypt(data)

    def decode(self, data: bytes) -> bytes:
        return self.fernet.decrypt(data)


class OtherKeyCodec(FernetCodec):
    def __init__(self) -> None:
        self.fernet = Fernet(Fernet.generate_key())
