"""Sealed values (worker/sealing.py): tables of what opens and what is refused, for both ciphers."""

from __future__ import annotations

import base64

import pytest

from worker.sealing import CIPHERS, KeyFileError, KeyRing, Sealer, Unsealable, new_key

KEY_NAME = "sluice:req:{acme:r1}:answer"


def sealer(cipher: str, active: str = "k1", ids=("k1",)) -> Sealer:
    size = CIPHERS[cipher][1]
    return Sealer({i: bytes([n + 1]) * size for n, i in enumerate(ids)}, active, cipher)


def flip(value: bytes, at: int) -> bytes:
    return value[:at] + bytes([value[at] ^ 1]) + value[at + 1:]


REFUSED = [
    ("a flipped ciphertext byte", lambda v: flip(v, len(v) - 20), KEY_NAME, "forged"),
    ("a flipped tag byte", lambda v: flip(v, len(v) - 1), KEY_NAME, "forged"),
    ("a flipped nonce byte", lambda v: flip(v, 9), KEY_NAME, "forged"),
    ("moved to another key", lambda v: v, "sluice:req:{globex:r1}:answer", "forged"),
    ("truncated", lambda v: v[:20], KEY_NAME, "corrupt"),
    ("stored in clear", lambda v: b'{"type":"done"}', KEY_NAME, "not_sealed"),
    ("an unknown key id", lambda v: v.replace(b"k1", b"k9", 1), KEY_NAME, "unknown_key"),
    ("another cipher id", lambda v: v[:4] + bytes([9]) + v[5:], KEY_NAME, "unknown_key"),
]


@pytest.mark.parametrize("cipher", list(CIPHERS))
def test_a_sealed_value_opens_only_unaltered_under_its_own_key_name(cipher):
    s = sealer(cipher)
    value = b"the answer" * 100
    sealed = s.seal(value, KEY_NAME)
    assert value not in sealed and b"the answer" not in sealed
    assert s.open(sealed, KEY_NAME) == value
    assert s.seal(value, KEY_NAME) != sealed  # a fresh nonce each time


@pytest.mark.parametrize("cipher", list(CIPHERS))
@pytest.mark.parametrize("what,alter,name,reason", REFUSED, ids=[r[0] for r in REFUSED])
def test_altered_moved_or_foreign_values_are_refused_with_a_reason(cipher, what, alter, name, reason):
    s = sealer(cipher)
    with pytest.raises(Unsealable) as err:
        s.open(alter(s.seal(b"x" * 64, KEY_NAME)), name)
    assert err.value.reason == reason


def test_values_sealed_under_an_old_key_open_after_rotation_and_new_writes_use_the_new_key():
    before = sealer("aes-256-gcm", "k1", ("k1",))
    after = sealer("aes-256-gcm", "k2", ("k1", "k2"))
    old = before.seal(b"page", KEY_NAME)
    assert after.open(old, KEY_NAME) == b"page"
    new = after.seal(b"page", KEY_NAME)
    assert b"k2" in new[:8] and after.open(new, KEY_NAME) == b"page"
    with pytest.raises(Unsealable, match="unknown_key"):
        before.open(new, KEY_NAME)  # a worker not yet given k2 treats it as a miss, never as garbage


def test_the_same_key_under_another_cipher_does_not_open():
    sm4 = Sealer({"k1": b"\x01" * 16}, "k1", "sm4-gcm")
    aes = Sealer({"k1": b"\x01" * 32}, "k1", "aes-256-gcm")
    with pytest.raises(Unsealable):
        aes.open(sm4.seal(b"v", KEY_NAME), KEY_NAME)


def write(tmp_path, text: str) -> str:
    path = tmp_path / "keys.toml"
    path.write_text(text)
    return str(path)


SECRET = base64.b64encode(b"\x07" * 32).decode()
BAD_FILES = [
    ("no keys table", 'active = "a"\n', "needs a \\[keys\\] table"),
    ("active key missing", f'active = "b"\n[keys]\na = "{SECRET}"\n', "active key 'b'"),
    ("wrong length for the cipher", f'cipher = "sm4-gcm"\nactive = "a"\n[keys]\na = "{SECRET}"\n', "needs 16"),
    ("not base64", 'active = "a"\n[keys]\na = "not base64!!"\n', "not base64"),
    ("unknown cipher", f'cipher = "des"\nactive = "a"\n[keys]\na = "{SECRET}"\n', "not one of"),
    ("not TOML", "[keys\n", "not valid TOML"),
]


@pytest.mark.parametrize("what,text,message", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_an_unusable_keys_file_stops_start_up_naming_the_problem_and_never_a_key(tmp_path, what, text, message):
    with pytest.raises(KeyFileError, match=message) as err:
        Sealer.from_file(write(tmp_path, text))
    assert SECRET not in str(err.value)


def test_a_keys_file_loads_and_new_keys_have_the_ciphers_length(tmp_path):
    for cipher, (_, size) in CIPHERS.items():
        key = new_key(cipher)
        assert len(base64.b64decode(key)) == size
        s = Sealer.from_file(write(tmp_path, f'cipher = "{cipher}"\nactive = "k"\n[keys]\nk = "{key}"\n'))
        assert s.open(s.seal(b"v", "n"), "n") == b"v"
    with pytest.raises(KeyFileError, match="not found"):
        Sealer.from_file(tmp_path / "absent.toml")


def test_a_key_ring_follows_its_file_and_keeps_its_keys_while_the_file_is_unusable(tmp_path):
    k1, k2 = new_key(), new_key()
    path = write(tmp_path, f'active = "k1"\n[keys]\nk1 = "{k1}"\n')
    ring = KeyRing(path, check_s=0)
    old = ring.seal(b"v", "n")
    write(tmp_path, "[keys\n")  # half-written: the keys in use stay
    assert ring.open(old, "n") == b"v" and ring.reload_failures == 1
    write(tmp_path, f'active = "k2"\n[keys]\nk1 = "{k1}"\nk2 = "{k2}"\n')  # rotated in place
    new = ring.seal(b"v", "n")
    assert b"k2" in new[:8] and ring.open(old, "n") == b"v"
    write(tmp_path, f'active = "k2"\n[keys]\nk2 = "{k2}"\n')  # the old key retired
    with pytest.raises(Unsealable, match="unknown_key"):
        ring.open(old, "n")
    assert ring.open(new, "n") == b"v"
