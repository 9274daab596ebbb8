"""Identities and signatures, pure: libp2p keys (the node's peer identity) and organiser keys (who
may publish a run's manifest). Bytes in, bytes or verdicts out; files and the DHT are node/'s.

libp2p keys are the ``PrivateKey``/``PublicKey`` protobufs (``KeyType`` field 1, key bytes
field 2). A peer id is that public-key protobuf as an identity multihash when it is at most 42
bytes (Ed25519, ``12D3KooW...``), else its sha2-256 multihash (RSA), in base58. So anyone holding a
record's public key can check that it belongs to the peer id the record claims, and a signature
by that key proves the peer wrote it. Ed25519 signs the message itself; RSA signs with PKCS#1 v1.5
over SHA-256, as libp2p does.

Only keys whose verification costs little are accepted (``peer_key_problem``): Ed25519, and RSA
with public exponent 65537 and a modulus of 2048 to 4096 bits. Anyone can write an RSA public
key with a huge exponent or modulus without holding its private half, and one verification with
it costs a hundred times an honest one; so a key is judged before any signature made with it is
verified, and a node refuses to start with such a key of its own.

An organiser key is a raw Ed25519 key pair; a run's manifest carries the public half (base64) and
a signature over the manifest hash, so no one else can publish a manifest that nodes accept for
that run (``docs/THREAT_MODEL.md``).
"""

from __future__ import annotations

import base64
import hashlib

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

KEY_RSA, KEY_ED25519 = 0, 1
RSA_EXPONENT = 65537  # the only RSA public exponent accepted (every libp2p implementation's default)
RSA_MIN_BITS, RSA_MAX_BITS = 2048, 4096  # accepted RSA modulus sizes
MAX_PUBLIC_KEY_BYTES = 1024  # a libp2p PublicKey protobuf of a 4096-bit RSA key is about 550 bytes
_ED25519_PRIVATE_LEN = 64  # seed (32) + public key (32), the libp2p encoding
_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_RAW = serialization.Encoding.Raw


# ----------------------------------------------------------------------------- libp2p key encoding


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        b = data[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n, pos


def key_message(key_type: int, data: bytes) -> bytes:
    """The libp2p ``PrivateKey``/``PublicKey`` protobuf: field 1 varint, field 2 bytes."""
    return b"\x08" + _varint(key_type) + b"\x12" + _varint(len(data)) + data


def parse_key_message(blob: bytes) -> tuple[int, bytes]:
    """(key type, key bytes) of a libp2p key protobuf; ``ValueError`` if it is not one."""
    fields: dict[int, int | bytes] = {}
    pos = 0
    while pos < len(blob):
        tag, pos = _read_varint(blob, pos)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            fields[number], pos = _read_varint(blob, pos)
        elif wire == 2:
            n, pos = _read_varint(blob, pos)
            if pos + n > len(blob):
                raise ValueError("truncated field")
            fields[number], pos = blob[pos : pos + n], pos + n
        else:
            raise ValueError(f"unexpected protobuf wire type {wire}")
    key_type, data = fields.get(1), fields.get(2)
    if not isinstance(key_type, int) or not isinstance(data, bytes):
        raise ValueError("missing key type or key data")
    return key_type, data


def b58encode(raw: bytes) -> str:
    n = int.from_bytes(raw, "big")
    out = []
    while n:
        n, r = divmod(n, 58)
        out.append(_B58[r])
    pad = len(raw) - len(raw.lstrip(b"\0"))
    return "1" * pad + "".join(reversed(out))


def peer_multihash(public_key: bytes) -> bytes:
    """The peer id (raw multihash bytes) of a libp2p ``PublicKey`` protobuf."""
    if len(public_key) <= 42:
        return b"\x00" + _varint(len(public_key)) + public_key
    return b"\x12\x20" + hashlib.sha256(public_key).digest()


def peer_id_of_public_key(public_key: bytes) -> str:
    """The peer id (base58) of a libp2p ``PublicKey`` protobuf."""
    return b58encode(peer_multihash(public_key))


def new_ed25519_key() -> bytes:
    """A fresh Ed25519 identity in the libp2p private-key file format."""
    key = Ed25519PrivateKey.generate()
    seed = key.private_bytes(_RAW, serialization.PrivateFormat.Raw, serialization.NoEncryption())
    return key_message(KEY_ED25519, seed + key.public_key().public_bytes(_RAW, serialization.PublicFormat.Raw))


class PeerKey:
    """A node's libp2p private key (the file ``swarm-node keygen`` writes): its peer id, its public
    key protobuf and signatures that :func:`verify_peer_signature` checks."""

    def __init__(self, blob: bytes):
        try:
            key_type, data = parse_key_message(blob)
        except ValueError as e:
            raise ValueError(f"not a libp2p private key ({e})") from None
        if key_type == KEY_ED25519:
            if len(data) not in (_ED25519_PRIVATE_LEN, 96):  # 96: old go-libp2p with a redundant copy
                raise ValueError(f"Ed25519 key data is {len(data)} bytes, expected 64")
            self._key = Ed25519PrivateKey.from_private_bytes(data[:32])
            public = self._key.public_key().public_bytes(_RAW, serialization.PublicFormat.Raw)
            if public != data[32:64]:
                raise ValueError("Ed25519 key: the public half does not match the seed (corrupted file)")
        elif key_type == KEY_RSA:
            try:
                self._key = serialization.load_der_private_key(data, password=None)
            except Exception as e:  # noqa: BLE001 - cryptography raises several types for bad DER
                raise ValueError(f"RSA key data does not parse: {e}") from None
            public = self._key.public_key().public_bytes(serialization.Encoding.DER,
                                                         serialization.PublicFormat.SubjectPublicKeyInfo)
        else:
            raise ValueError(f"key type {key_type} is not supported (Ed25519 or RSA)")
        self.key_type = key_type
        self.public_key = key_message(key_type, public)
        problem = peer_key_problem(self.public_key)
        if problem is not None:  # every node of the swarm would refuse its records
            raise ValueError(f"this key's signatures are refused by the swarm: {problem}")
        self.peer_id_bytes = peer_multihash(self.public_key)
        self.peer_id = b58encode(self.peer_id_bytes)

    def sign(self, data: bytes) -> bytes:
        if self.key_type == KEY_ED25519:
            return self._key.sign(data)
        return self._key.sign(data, padding.PKCS1v15(), hashes.SHA256())


def peer_id_from_key(blob: bytes) -> str:
    """Peer id (base58) of a private key in the libp2p file format; ``ValueError`` if it is not one."""
    return PeerKey(blob).peer_id


def peer_key_problem(public_key: bytes, signature: bytes | None = None) -> str | None:
    """None when the libp2p ``PublicKey`` protobuf ``public_key`` is of a kind whose signatures are
    cheap to verify (Ed25519; RSA with exponent 65537 and a 2048..4096-bit modulus) and, when
    ``signature`` is given, that signature has the length such a key's signatures have; else what
    is wrong. Parses the key only (its size bounded first), never verifies anything."""
    if not isinstance(public_key, bytes) or len(public_key) > MAX_PUBLIC_KEY_BYTES:
        return f"a public key is bytes of at most {MAX_PUBLIC_KEY_BYTES}"
    try:
        key_type, raw = parse_key_message(public_key)
    except ValueError as e:
        return f"not a libp2p public key ({e})"
    if key_type == KEY_ED25519:
        if len(raw) != 32:
            return f"an Ed25519 public key is 32 bytes, not {len(raw)}"
        expected = 64
    elif key_type == KEY_RSA:
        try:
            key = serialization.load_der_public_key(raw)
        except (ValueError, TypeError, UnsupportedAlgorithm) as e:
            return f"the RSA public key does not parse ({e})"
        if not isinstance(key, rsa.RSAPublicKey):
            return "key type RSA holds a key that is not RSA"
        numbers = key.public_numbers()
        if numbers.e != RSA_EXPONENT:
            shown = str(numbers.e) if numbers.e < 1 << 32 else f"of {numbers.e.bit_length()} bits"
            return f"RSA public exponent {shown} (only {RSA_EXPONENT})"
        if not RSA_MIN_BITS <= key.key_size <= RSA_MAX_BITS:
            return f"RSA modulus of {key.key_size} bits (only {RSA_MIN_BITS}..{RSA_MAX_BITS})"
        expected = (key.key_size + 7) // 8
    else:
        return f"key type {key_type} (only Ed25519 and RSA)"
    if signature is not None and (not isinstance(signature, bytes) or len(signature) != expected):
        return f"a signature by this key is {expected} bytes"
    return None


def verify_peer_signature(public_key: bytes, data: bytes, signature: bytes) -> bool:
    """Whether ``signature`` over ``data`` was made by the libp2p key ``public_key`` (a protobuf);
    False for anything malformed and for a key ``peer_key_problem`` refuses (judged first)."""
    if peer_key_problem(public_key, signature) is not None:
        return False
    try:
        key_type, raw = parse_key_message(public_key)
        if key_type == KEY_ED25519:
            Ed25519PublicKey.from_public_bytes(raw).verify(signature, data)
        elif key_type == KEY_RSA:
            serialization.load_der_public_key(raw).verify(signature, data, padding.PKCS1v15(), hashes.SHA256())
        else:
            return False
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


# ----------------------------------------------------------------------------- organiser keys

ORGANISER_KEY_HEADER = "swarm-node organiser key v1"
_MANIFEST_CONTEXT = b"swarm-node manifest v1\0"


class OrganiserKey:
    """The Ed25519 key a run's organisers sign its manifest with."""

    def __init__(self, key: Ed25519PrivateKey):
        self._key = key
        self.public = base64.b64encode(key.public_key().public_bytes(_RAW, serialization.PublicFormat.Raw)).decode()

    @classmethod
    def generate(cls) -> OrganiserKey:
        return cls(Ed25519PrivateKey.generate())

    def to_text(self) -> str:
        seed = self._key.private_bytes(_RAW, serialization.PrivateFormat.Raw, serialization.NoEncryption())
        return f"{ORGANISER_KEY_HEADER}\n{base64.b64encode(seed).decode()}\n"

    @classmethod
    def from_text(cls, text: str) -> OrganiserKey:
        lines = text.strip().splitlines()
        if len(lines) != 2 or lines[0].strip() != ORGANISER_KEY_HEADER:
            raise ValueError(f"not an organiser key (expected a first line {ORGANISER_KEY_HEADER!r})")
        try:
            seed = base64.b64decode(lines[1].strip(), validate=True)
            return cls(Ed25519PrivateKey.from_private_bytes(seed))
        except ValueError as e:
            raise ValueError(f"the organiser key does not decode: {e}") from None

    def sign_manifest(self, manifest_hash: str) -> str:
        """The signature (base64) over a manifest hash (hex) whose ``run.organiser`` is this key."""
        return base64.b64encode(self._key.sign(_MANIFEST_CONTEXT + bytes.fromhex(manifest_hash))).decode()


def organiser_fingerprint(public: str) -> str:
    """A short, stable name for an organiser public key (base64): 16 hex digits of its sha256.
    A run's DHT namespace includes it, so runs of two organisers never share records."""
    return hashlib.sha256(public.encode()).hexdigest()[:16]


def verify_manifest_signature(public: str, manifest_hash: str, signature: str) -> bool:
    """Whether ``signature`` (base64) is the organiser key ``public``'s (base64) over ``manifest_hash``."""
    try:
        key = Ed25519PublicKey.from_public_bytes(base64.b64decode(public, validate=True))
        key.verify(base64.b64decode(signature, validate=True), _MANIFEST_CONTEXT + bytes.fromhex(manifest_hash))
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


def manifest_signature_problem(manifest) -> str | None:
    """None when ``manifest`` (a ``stages.Manifest``) carries a valid signature by its own
    ``run.organiser`` key; else what is wrong, in words an operator can act on."""
    from stages import manifest_hash

    if not manifest.run.organiser:
        return "the manifest is not signed (no run.organiser)"
    if not manifest.signature.ed25519:
        return "the manifest names an organiser key but carries no [signature]"
    if not verify_manifest_signature(manifest.run.organiser, manifest_hash(manifest), manifest.signature.ed25519):
        return ("its signature does not verify with the organiser key in run.organiser: the file was changed "
                "after signing, or signed with another key")
    return None
