"""Our vLLM contact code against the surface snapshots of vLLM 0.32.0 and 0.33.0.

The snapshots (``vllm_sessionkv/_vllm/surfaces/``) were written from each release's
wheel by ``vllm_sessionkv/dev/vllm_surface.py``; this test reads them, not the wheels,
and recomputes from our source what our code touches now:

* every item our code touches is in each snapshot (a new import, override or private
  attribute needs the snapshots rewritten: the message says how);
* in 0.32.0, the tested release, nothing we import or override is missing;
* the differences from 0.32.0 to 0.33.0 are printed, and are exactly the ones
  docs/vllm_0.33_surface.md reports and the engine names when it refuses 0.33.0;
* the KV-event fields our proxy copies (``events.py``) cover each release's, and the
  proxy decodes a 0.33 BlockStored with its new trailing field.

The extractor itself runs on a small made-up wheel: a name removed, a signature
changed and a private attribute gone each show as a difference (the negative
control).  About 2 s.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import msgspec
import pytest

from vllm_sessionkv._vllm import surfaces
from vllm_sessionkv.dev import vllm_surface

REPO = Path(__file__).resolve().parents[2]
TESTED, NEXT = "0.32.0", "0.33.0"
# What docs/vllm_0.33_surface.md reports; the engine's refusal names the same.
_NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl."
EXPECTED_0_33 = [
    f"overrides {_NIXL}pull_scheduler:NixlPullConnectorScheduler.request_finished: code changed",
    f"overrides {_NIXL}pull_scheduler:NixlPullConnectorScheduler.set_xfer_handshake_metadata: "
    "code changed",
    f"overrides {_NIXL}pull_worker:NixlPullConnectorWorker.__init__: code changed",
    f"overrides {_NIXL}pull_worker:NixlPullConnectorWorker.register_kv_caches: code changed",
    "attributes _execute_worker_rpc: code changed",
    "attributes _handle_client_request: code changed",
    "attributes _process_input_queue: code changed",
    "attributes _read_blocks_for_req: code changed",
    "attributes hash_block_size: added ... 4 more; removed ... 3 more",
    "attributes use_v2_model_runner: code changed",
    f"inherited_methods {_NIXL}connector:NixlPullConnector: added restore_kv_caches, "
    "supports_sleep_mode, unregister_kv_caches",
    f"inherited_methods {_NIXL}pull_worker:NixlPullConnectorWorker: added restore_kv_caches, "
    "unregister_kv_caches",
    "kv_event_fields BlockStored: added lookahead_token_ids",
]
REWRITE = ("pip download --no-deps vllm==VERSION, then python -m "
           "vllm_sessionkv.dev.vllm_surface vllm-VERSION-*.whl")


@pytest.fixture(scope="module")
def ours() -> vllm_surface.Touched:
    return vllm_surface.touched()


@pytest.mark.parametrize("version", [TESTED, NEXT])
def test_each_snapshot_covers_what_our_code_touches(ours, version):
    """A new vLLM import, or a new method of ours that overrides one of the vLLM
    class's members, needs the snapshots rewritten.  A new method of our own (no such
    member in vLLM) does not; a new private attribute is listed, not failed (the
    snapshot cannot tell ours from vLLM's without the wheel)."""
    snap = surfaces.load(version)
    assert snap is not None and snap["vllm_version"] == version
    missing = sorted(set(ours.imports) - set(snap["imports"]))
    missing += sorted(f"{b}.{m}" for b, m in ours.overrides
                      if f"{b}.{m}" not in snap["overrides"]
                      and m in snap["base_members"].get(b, [m]))
    assert not missing, f"not in the {version} snapshot: {missing}; rewrite it ({REWRITE})"
    unseen = sorted(set(ours.attributes) - set(snap["attributes"]))
    if unseen:
        print(f"attributes not in the {version} snapshot (ours, or rewrite it): {unseen}")


def test_the_tested_release_has_everything_we_import_and_override():
    snap = surfaces.load(TESTED)
    absent = [k for section in ("imports", "overrides") for k, v in snap[section].items()
              if v.startswith("missing")]
    assert not absent, absent


def test_the_differences_to_0_33_are_the_reported_ones():
    found = surfaces.differences(TESTED, NEXT)
    print(f"vLLM {TESTED} -> {NEXT}, what our contact code touches:")
    for line in found or ["(no differences)"]:
        print("  " + line)
    assert found == EXPECTED_0_33
    report = " ".join((REPO / "docs" / "vllm_0.33_surface.md").read_text().split())
    for line in found:
        item = line.split(": ")[0].split(" ", 1)[1].rsplit(":", 1)[-1]
        assert item in report, f"docs/vllm_0.33_surface.md does not report {item} ({line})"


@pytest.mark.parametrize("version", [TESTED, NEXT])
def test_the_proxy_event_copies_cover_each_release(version):
    from sessionkv_proxy import events

    fields = surfaces.load(version)["kv_event_fields"]
    for struct, names in fields.items():
        ours_struct = {"EventBatch": events.KVEventBatch}.get(struct) or getattr(events, struct)
        known = set(ours_struct.__struct_fields__)
        # A field we do not copy is ignored when decoding (maps) or trailing (arrays).
        extra = [n for n in names if n not in known]
        assert version != TESTED or not extra, (struct, extra)


def test_a_0_33_block_stored_with_its_new_field_decodes():
    from sessionkv_proxy.events import BlockStored, decode_batch

    event = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
             "token_ids": list(range(32)), "block_size": 16, "lora_id": None,
             "medium": "GPU", "lora_name": None, "group_idx": 0,
             "lookahead_token_ids": [[16, 17], [32, 33]]}
    batch = decode_batch(msgspec.msgpack.encode([1.0, [event], 0, "a later field"]))
    assert isinstance(batch.events[0], BlockStored)
    assert batch.events[0].token_ids == list(range(32))


def _fake_wheel(path: Path, files: dict[str, str]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return path


def test_the_extractor_sees_a_removed_name_a_changed_signature_and_a_lost_attribute(
        tmp_path):
    base = {
        "vllm/__init__.py": "",
        "vllm/x/__init__.py": "",
        "vllm/x/y/__init__.py": "",
        "vllm/x/y/base.py": "class Base:\n    def __init__(self):\n        self._held = {}\n"
                          "    def step(self, a, b=1):\n        pass\n",
        "vllm/x/y/api.py": "from .base import Base\ndef helper(n):\n    pass\n",
    }
    changed = dict(base)
    changed["vllm/x/y/base.py"] = ("class Base:\n    def __init__(self):\n        self._kept = {}\n"
                                 "    def step(self, a, *, b=1):\n        pass\n")
    changed["vllm/x/y/api.py"] = "from .base import Base\n"
    what = vllm_surface.Touched(imports={"vllm.x.y.api:Base", "vllm.x.y.api:helper"},
                                overrides={("vllm.x.y.api:Base", "step")},
                                attributes={"_held"})
    snaps = {}
    for name, files in (("1.0.0", base), ("1.1.0", changed)):
        index = vllm_surface.WheelIndex.from_wheel(_fake_wheel(tmp_path / f"{name}.whl", files))
        snaps[name] = vllm_surface.snapshot(index, what, name, "w", "0")
    assert snaps["1.0.0"]["imports"] == {"vllm.x.y.api:Base": "class",
                                         "vllm.x.y.api:helper": "function (n)"}
    assert snaps["1.0.0"]["overrides"]["vllm.x.y.api:Base.step"].startswith(
        "Base.step (self, a, b=) code ")
    assert snaps["1.0.0"]["attributes"] == {"_held": ["vllm.x.y.base:Base attribute"]}
    assert snaps["1.1.0"]["imports"]["vllm.x.y.api:helper"] == "missing"
    assert snaps["1.1.0"]["overrides"]["vllm.x.y.api:Base.step"].startswith(
        "Base.step (self, a, *, b=) code ")
    assert snaps["1.1.0"]["attributes"]["_held"] == []
