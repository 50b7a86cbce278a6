"""Settings: tier lists, env parsing, and the tiers they build."""

import os

import pytest

from kvstore.engine.build import build_tiers, nvme_layout
from kvstore.config import Settings
from kvstore.errors import InvalidInput

MiB = 1 << 20


def test_defaults_are_the_embedded_stack():
    s = Settings()
    assert s.tier_names() == ["shm", "cxl", "nvme"]
    assert s.data_dir == "./kvstore-data" and s.redis_url is None


def test_redis_url_puts_redis_above_nvme():
    assert Settings(redis_url="redis://127.0.0.1:6379/0").tier_names() == ["shm", "cxl", "redis", "nvme"]
    assert Settings(tiers="memory", redis_url="redis://x:1").tier_names() == ["memory", "redis"]
    assert Settings(tiers="redis,shm", redis_url="redis://x:1").tier_names() == ["redis", "shm"]


@pytest.mark.parametrize("tiers", ["", "shm,shm", "shm,tape", "gpu"])
def test_bad_tier_lists(tiers):
    with pytest.raises(InvalidInput, match="tiers"):
        Settings(tiers=tiers)


def test_env_forms(monkeypatch):
    monkeypatch.setenv("KVSTORE_TIERS", " SHM , nvme ")
    monkeypatch.setenv("KVSTORE_SHM_BYTES", "64MiB")
    monkeypatch.setenv("KVSTORE_CXL_NODE", "0")
    monkeypatch.setenv("KVSTORE_REDIS_URL", "redis+cluster://127.0.0.1:7000")
    s = Settings.from_env()
    assert s.tiers == "shm,redis,nvme" and s.shm_bytes == 64 * MiB and s.cxl_node == 0
    assert s.tier_names() == ["shm", "redis", "nvme"]
    monkeypatch.setenv("KVSTORE_CXL_NODE", "far")
    with pytest.raises(InvalidInput, match="KVSTORE_CXL_NODE"):
        Settings.from_env()
    monkeypatch.setenv("KVSTORE_CXL_NODE", "")
    monkeypatch.setenv("KVSTORE_REDIS_URL", "http://nope")
    with pytest.raises(InvalidInput, match="redis_url"):
        Settings.from_env()


def test_steady_state_settings_parse_and_refuse_bad_values(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSTORE_NVME_SYNC_INTERVAL_S", "0.25")
    monkeypatch.setenv("KVSTORE_FULL_TOP_TIER", "evict")
    s = Settings.from_env()
    assert s.nvme_sync_interval_s == 0.25 and s.full_top_tier == "evict"
    assert Settings().nvme_sync_interval_s == 0.1 and Settings().full_top_tier == "spill"
    monkeypatch.setenv("KVSTORE_TOP_TIER_LOW_WATERMARK", "0.8")
    assert Settings.from_env().top_tier_low_watermark == 0.8 and Settings().top_tier_low_watermark == 0.9
    monkeypatch.delenv("KVSTORE_TOP_TIER_LOW_WATERMARK")
    for name, bad, says in (("KVSTORE_NVME_SYNC_INTERVAL_S", "soon", "KVSTORE_NVME_SYNC_INTERVAL_S"),
                            ("KVSTORE_NVME_SYNC_INTERVAL_S", "-1", "nvme_sync_interval_s"),
                            ("KVSTORE_FULL_TOP_TIER", "drop", "full_top_tier"),
                            ("KVSTORE_TOP_TIER_LOW_WATERMARK", "most", "KVSTORE_TOP_TIER_LOW_WATERMARK"),
                            ("KVSTORE_TOP_TIER_LOW_WATERMARK", "0.97", r"top_tier_low_watermark .*0\.95"),
                            ("KVSTORE_TOP_TIER_LOW_WATERMARK", "0", "top_tier_low_watermark"),
                            ("KVSTORE_TOP_TIER_LOW_WATERMARK", "nan", "top_tier_low_watermark")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(InvalidInput, match=says):
            Settings.from_env()
        monkeypatch.delenv(name)
    for interval, says in ((0, "each put"), (0.2, "group commit every 0.2 s")):
        tier = build_tiers(Settings(tiers="nvme", data_dir=str(tmp_path / str(interval)),
                                    nvme_sync_interval_s=interval))[0]
        try:
            assert tier.stats().details["fsync"].startswith(says)
        finally:
            tier.close()


def test_the_nvme_layout_setting_picks_the_tier_and_its_directory(monkeypatch, tmp_path):
    assert Settings().nvme_layout == "auto"
    monkeypatch.setenv("KVSTORE_NVME_LAYOUT", "segments")
    with pytest.raises(InvalidInput, match="nvme_layout"):
        Settings.from_env()
    monkeypatch.setenv("KVSTORE_NVME_LAYOUT", "log")
    for layout, directory in (("files", "nvme"), ("log", "nvme-log")):
        s = Settings(tiers="nvme", data_dir=str(tmp_path), nvme_layout=layout, nvme_sync_interval_s=0.1)
        tier = build_tiers(s)[0]
        try:
            tier.put(b"k" * 32, b"frame")
            assert tier.stats().details.get("layout", "").startswith("log" if layout == "log" else "ab/")
            assert tier.data_dir == str(tmp_path / directory)
        finally:
            tier.close()
    assert Settings.from_env().nvme_layout == "log"


def test_build_closes_what_it_built_when_a_later_tier_fails(monkeypatch):
    import tiers.shm

    made: list[str] = []

    class Recorded(tiers.shm.ShmTier):  # the arena this build makes: its own segment, not all of the pid's
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self.path)

    monkeypatch.setattr(tiers.shm, "ShmTier", Recorded)
    with pytest.raises(InvalidInput):
        build_tiers(Settings(tiers="shm,redis", shm_bytes=MiB))  # redis named, but no URL
    assert made, "the shm arena was not built first"
    assert not [p for p in made if os.path.exists(p)], "the shm arena built first was not closed and unlinked"


def test_auto_layout_is_the_log_but_an_older_data_dir_keeps_its_files(tmp_path):
    key = b"k" * 32
    old = Settings(tiers="nvme", data_dir=str(tmp_path / "old"), nvme_layout="files")
    tier = build_tiers(old)[0]
    tier.put(key, b"frame of the file layout")
    tier.close()
    for data_dir, layout, directory in ((tmp_path / "new", "log", "nvme-log"), (tmp_path / "old", "files", "nvme")):
        s = Settings(tiers="nvme", data_dir=str(data_dir))
        assert s.nvme_layout == "auto" and nvme_layout(s) == (layout, str(data_dir / directory))
        tier = build_tiers(s)[0]
        try:
            assert tier.data_dir == str(data_dir / directory)
            if layout == "files":
                assert bytes(tier.get(key)) == b"frame of the file layout"  # the upgrade kept the block
        finally:
            tier.close()
    # once a log exists beside it, the log wins: the layout a server last ran stays its layout
    (tmp_path / "old" / "nvme-log").mkdir()
    assert nvme_layout(Settings(data_dir=str(tmp_path / "old")))[0] == "log"
