"""The host-DRAM and SSD stores of the KV tiers on their own: LRU within a bounded size,
pins, bit-exact SSD round trips, corrupted or truncated or foreign files read as misses,
files edited or planted without the tier's key refused, a private folder, and the SSD index
rebuilt from the folder (warm restart)."""

from __future__ import annotations

import os
import stat
from array import array
from pathlib import Path

import pytest
import torch

from hetero_pd.engine.kv_tiers import blockfile
from hetero_pd.engine.kv_tiers.disk import DiskTier, ReadResult
from hetero_pd.engine.kv_tiers.host import HostTier
from hetero_pd.engine.kv_tiers.namespace import kv_namespace

BLOCK = (6, 4, 2, 8)  # (KV tensors, block_size, kv_heads, head_dim)
NS = bytes(range(16))
TOKENS = (1, 2, 3, 4)
KEY = bytes(range(100, 132))


def block(seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(BLOCK, generator=torch.Generator().manual_seed(seed)).to(dtype)


def disk_tier(
    root: Path,
    n_files: int,
    dtype: torch.dtype = torch.float32,
    ns: bytes = NS,
    key: bytes = KEY,
) -> DiskTier:
    block_bytes = block(0, dtype).numel() * block(0, dtype).element_size()
    file_bytes = blockfile.HEADER_SIZE + block_bytes
    return DiskTier(root, ns, n_files * file_bytes, block_bytes, key)


def test_host_tier_is_lru_and_never_evicts_pinned_blocks() -> None:
    host = HostTier(torch.zeros(3, *BLOCK))
    for h in (10, 11, 12):
        slot = host.reserve()
        assert slot is not None
        host.buffer[slot] = block(h)
        assert host.store(slot, h, TOKENS, pin=False)
    assert host.pin(10, TOKENS) is not None  # 10 pinned and most recent
    assert host.pin(11, (9, 9, 9, 9)) is None, "same hash, other tokens: a miss"
    host.touch(11)  # 12 is now the least recently used unpinned block
    slot = host.reserve()
    assert slot is not None and not host.contains(12, TOKENS)
    assert host.contains(10, TOKENS) and host.contains(11, TOKENS)
    assert host.store(slot, 13, TOKENS, pin=False)  # order now: 10 (pinned), 11, 13
    slot = host.reserve()
    assert slot is not None and not host.contains(11, TOKENS) and host.contains(10, TOKENS)
    assert host.store(slot, 14, TOKENS, pin=True)
    slot = host.reserve()  # 13 is the only unpinned block
    assert slot is not None and not host.contains(13, TOKENS)
    host.release(slot)
    assert host.reserve() == slot, "a released slot is free again"
    assert host.reserve() is None, "every stored block is pinned"
    assert host.num_stored == 2 and host.evictions == 3
    host.unpin(10)
    host.unpin(14)
    with pytest.raises(RuntimeError, match="unpinned more than pinned"):
        host.unpin(14)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ssd_round_trip_is_bit_exact(tmp_path: Path, dtype: torch.dtype) -> None:
    disk = disk_tier(tmp_path, 4, dtype)
    data = block(7, dtype)
    assert disk.write(0xABC, TOKENS, data)
    assert not disk.write(0xABC, TOKENS, data), "written once"
    out = torch.zeros_like(data)
    assert disk.read_into(0xABC, TOKENS, out) is ReadResult.OK
    assert torch.equal(out.view(torch.uint8), data.view(torch.uint8))
    assert disk.read_into(0xDEF, TOKENS, out) is ReadResult.MISSING
    disk.close()


def corrupt(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", ["payload bit", "header bit", "truncated", "extra byte"])
def test_a_damaged_file_is_a_miss_and_is_deleted(tmp_path: Path, damage: str) -> None:
    disk = disk_tier(tmp_path, 4)
    assert disk.write(5, TOKENS, block(5))
    path = disk.dir / f"{5:016x}.kv"
    size = path.stat().st_size
    if damage == "payload bit":
        corrupt(path, size - 3)
    elif damage == "header bit":
        corrupt(path, 40)
    elif damage == "truncated":
        os.truncate(path, size - 100)
    else:
        with path.open("ab") as f:
            f.write(b"\0")
    out = torch.full(BLOCK, 7.0)
    assert disk.read_into(5, TOKENS, out) is ReadResult.CORRUPT
    assert not path.exists() and not disk.contains(5)
    disk.close()


def test_a_file_of_another_block_or_model_is_a_miss(tmp_path: Path) -> None:
    disk = disk_tier(tmp_path, 4)
    assert disk.write(5, TOKENS, block(5))
    out = torch.zeros(BLOCK)
    assert disk.read_into(5, (4, 3, 2, 1), out) is ReadResult.CORRUPT  # other token ids
    assert disk.write(6, TOKENS, block(6))
    os.replace(disk.dir / f"{6:016x}.kv", disk.dir / f"{7:016x}.kv")  # renamed
    assert disk.read_into(7, TOKENS, out) is ReadResult.CORRUPT
    disk.close()
    # the same bytes in another model's folder fail the namespace check
    mine = disk_tier(tmp_path, 4)
    assert mine.write(8, TOKENS, block(8))
    mine.close()
    other = disk_tier(tmp_path, 4, ns=bytes(16))
    (mine.dir / f"{8:016x}.kv").rename(other.dir / f"{8:016x}.kv")
    other.close()
    other = disk_tier(tmp_path, 4, ns=bytes(16))
    assert not other.contains(8), "not listed on restart"
    assert other.read_into(8, TOKENS, out) is ReadResult.MISSING
    other.close()


def planted(key: bytes, block_hash: int, tokens: tuple[int, ...], kv: torch.Tensor) -> bytes:
    """A block file as someone who knows the format, but not the tier's key, would make."""
    payload = kv.reshape(-1).view(torch.uint8).numpy().data
    return blockfile.encode_header(key, NS, block_hash, tokens, payload) + bytes(payload)


def test_a_file_edited_or_planted_without_the_key_is_refused(tmp_path: Path) -> None:
    """Files are sealed with a keyed MAC: KV written for a prefix by anyone without the
    tier's key (edited in place, planted under a new name, or written by another
    deployment) is refused, on restart and when read; the token ids are not in clear."""
    disk = disk_tier(tmp_path, 4)
    assert disk.write(5, TOKENS, block(5))
    path = disk.dir / f"{5:016x}.kv"
    assert array("q", TOKENS).tobytes() not in path.read_bytes()
    attacker = os.urandom(32)
    path.write_bytes(planted(attacker, 5, TOKENS, block(99)))  # chosen KV for this prefix
    (disk.dir / f"{6:016x}.kv").write_bytes(planted(attacker, 6, TOKENS, block(99)))
    out = torch.zeros(BLOCK)
    assert disk.read_into(5, TOKENS, out) is ReadResult.CORRUPT and not path.exists()
    disk.close()
    (disk.dir / f"{5:016x}.kv").write_bytes(planted(attacker, 5, TOKENS, block(99)))
    again = disk_tier(tmp_path, 4)  # a restart lists none of them
    assert not again.contains(5) and not again.contains(6)
    assert sorted(again.dir.glob("*.kv")) == []
    assert again.write(7, TOKENS, block(7))
    again.close()
    other = disk_tier(tmp_path, 4, key=bytes(32))  # another deployment's key, same folder
    assert not other.contains(7)
    assert other.read_into(7, TOKENS, out) is ReadResult.MISSING
    other.close()


def test_the_folder_is_private(tmp_path: Path) -> None:
    """0700 folder, 0600 files; a folder of ours others could read is made private; a
    folder of another user, or under a root others may write, is refused by name."""
    root = tmp_path / "ssd"
    disk = disk_tier(root, 4)
    assert disk.write(5, TOKENS, block(5))
    assert stat.S_IMODE(disk.dir.stat().st_mode) == 0o700
    for path in disk.dir.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    disk.close()
    disk.dir.chmod(0o755)
    disk_tier(root, 4).close()
    assert stat.S_IMODE(disk.dir.stat().st_mode) == 0o700
    root.chmod(0o777)
    with pytest.raises(PermissionError, match="may be written by other users"):
        disk_tier(root, 4)
    root.chmod(0o1777)  # sticky: others cannot rename our folder
    disk_tier(root, 4).close()
    root.chmod(0o700)
    if os.geteuid() == 0:  # a folder of another user (only root can make one here)
        os.chown(disk.dir, 4321, 4321)
        with pytest.raises(PermissionError, match="not a folder of this user"):
            disk_tier(root, 4)


def test_index_survives_a_restart_in_lru_order_and_within_capacity(tmp_path: Path) -> None:
    disk = disk_tier(tmp_path, 3)
    for h in (1, 2, 3):
        assert disk.write(h, TOKENS, block(h))
        os.utime(disk.dir / f"{h:016x}.kv", (h, h))  # 1 oldest
    assert disk.write(4, TOKENS, block(4)), "full: the least recently used file goes"
    assert not disk.contains(1) and not (disk.dir / f"{1:016x}.kv").exists()
    assert sorted(p.name for p in disk.dir.glob("*.kv")) == [f"{h:016x}.kv" for h in (2, 3, 4)]
    (disk.dir / ".0000000000000009.kv.123.tmp").write_bytes(b"half a write")
    (disk.dir / f"{9:016x}.kv").write_bytes(b"short")
    disk.close()
    # a smaller tier on restart keeps the most recent files
    disk = disk_tier(tmp_path, 2)
    assert [disk.contains(h) for h in (2, 3, 4, 9)] == [False, True, True, False]
    assert not list(disk.dir.glob("*.tmp")) and not (disk.dir / f"{9:016x}.kv").exists()
    out = torch.zeros(BLOCK)
    assert disk.read_into(3, TOKENS, out) is ReadResult.OK and torch.equal(out, block(3))
    disk.close()


def test_one_engine_per_ssd_folder(tmp_path: Path) -> None:
    disk = disk_tier(tmp_path, 2)
    with pytest.raises(RuntimeError, match="in use by another engine"):
        disk_tier(tmp_path, 2)
    disk.close()
    disk_tier(tmp_path, 2).close()  # released on close


def test_too_small_an_ssd_tier_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="holds no KV block"):
        DiskTier(tmp_path, NS, 100, 1000, KEY)


def test_namespace_tells_models_dtypes_and_shapes_apart(
    tiny_llama_dir: Path, tiny_qwen2_dir: Path
) -> None:
    base = kv_namespace(tiny_llama_dir, torch.float32, (16, 2, 16), 6)
    assert base == kv_namespace(tiny_llama_dir, torch.float32, (16, 2, 16), 6)
    assert len(base) == 16
    others = [
        kv_namespace(tiny_qwen2_dir, torch.float32, (16, 2, 16), 6),
        kv_namespace(tiny_llama_dir, torch.bfloat16, (16, 2, 16), 6),
        kv_namespace(tiny_llama_dir, torch.float32, (8, 2, 16), 6),
        kv_namespace(tiny_llama_dir, torch.float32, (16, 2, 16), 6, "fractal_nz"),
    ]
    assert base not in others and len(set(others)) == 4
