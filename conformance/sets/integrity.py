"""Integrity of a fixture set: the schema, the sha256 of every file, the stored tensors against the cases,
and an external set's checkpoint. ``load_set`` refuses a set with any problem (FixtureError, exit 3);
``check_set`` lists every problem. Recomputing the goldens with the oracle is ``conformance.generate.recompute``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from refimpl.errors import WeightsError
from refimpl.safetensors_io import TensorStore, read_header

from .archive import is_archive, unpack
from .case import Case, check_case
from .checkpoint import not_checked_note, recorded_dir
from .fixture_set import FixtureSet
from .format import (
    AUDIO_LEAVES,
    BASE_FILE_RE,
    BASE_LEAVES,
    CASES,
    EXPECTED,
    IMAGE_LEAVES,
    MANIFEST,
    MEDIA_LEAVES,
    MTP_FILE,
    MTP_TENSOR_RE,
    SET_FILES,
    FixtureError,
    read_json,
    sha256_file,
)
from .head import SUMMARY_LEAVES
from .manifest import check_manifest


def _stored_items(infos: Mapping[str, Any], kind: str, b: str, leaves: tuple[str, ...],
                  where: str) -> tuple[list[tuple[str, tuple]], list[str]]:
    """The stored images/clips ``<kind>/<b>/<j>/<leaf>`` of base ``b`` (counted by the first leaf) as
    (name prefix, the leaves' tensor infos), and a problem for each one missing a leaf."""
    items, out, j = [], [], 0
    while f"{kind}/{b}/{j}/{leaves[0]}" in infos:
        prefix = f"{kind}/{b}/{j}/"
        got = [infos.get(prefix + leaf) for leaf in leaves]
        missing = [leaf for leaf, info in zip(leaves, got, strict=True) if info is None]
        if missing:
            out.append(f"{where}: {prefix}{missing[0]} is missing")
        items.append((prefix, tuple(got)))
        j += 1
    return items, out


def _check_audio_tensors(infos: Mapping[str, Any], b: str, N: int, where: str) -> list[str]:
    """Shapes and dtypes of an audio base's tensors."""
    emb, au = infos.get(f"base/{b}/embeddings"), infos[f"base/{b}/audio"]
    out = []
    if emb is None or emb.dtype != "F64" or len(emb.shape) != 2 or emb.shape[0] != N:
        out.append(f"{where}: audio base {b} needs base/{b}/embeddings as F64 [{N}, H]")
    if au.dtype != "I64" or len(au.shape) != 2 or au.shape[1] != 2 or au.shape[0] < 1:
        return out + [f"{where}: base/{b}/audio must be I64 [n, 2] (first position, soft tokens), got {au.dtype} "
                      f"{list(au.shape)}"]
    clips, missing = _stored_items(infos, "audio", b, AUDIO_LEAVES, where)
    if len(clips) != au.shape[0]:
        out.append(f"{where}: base {b} has {au.shape[0]} audio blocks but {len(clips)} stored clips")
    out += missing
    for p, (wave, feats, mask, st) in clips:
        if None in (wave, feats, mask, st):
            continue
        if wave.dtype != "F64" or len(wave.shape) != 1:
            out.append(f"{where}: {p}waveform must be F64 [n]")
        if feats.dtype != "F64" or len(feats.shape) != 2 or mask.dtype != "U8" or mask.shape != feats.shape[:1]:
            out.append(f"{where}: {p}features must be F64 [T, F] and {p}mask U8 [T]")
        if st.dtype != "F64" or len(st.shape) != 2 or (emb is not None and st.shape[1] != emb.shape[-1]):
            out.append(f"{where}: {p}soft_tokens must be F64 [M, H]")
    return out


def _check_image_tensors(infos: Mapping[str, Any], b: str, N: int, where: str) -> list[str]:
    """Shapes and dtypes of an image base's tensors (none of them for a text base)."""
    if f"base/{b}/audio" in infos:
        return _check_audio_tensors(infos, b, N, where)
    emb, im = infos.get(f"base/{b}/embeddings"), infos.get(f"base/{b}/images")
    images, missing = _stored_items(infos, "image", b, IMAGE_LEAVES, where)
    if emb is None and im is None and not images:
        return []
    if emb is None or im is None:
        return [f"{where}: image base {b} needs both base/{b}/embeddings and base/{b}/images"]
    out = []
    if emb.dtype != "F64" or len(emb.shape) != 2 or emb.shape[0] != N:
        out.append(f"{where}: base/{b}/embeddings must be F64 [{N}, H], got {emb.dtype} {list(emb.shape)}")
    if im.dtype != "I64" or len(im.shape) != 2 or im.shape[1] != 2 or im.shape[0] < 1:
        return out + [f"{where}: base/{b}/images must be I64 [n, 2] (first position, soft tokens), got {im.dtype} "
                      f"{list(im.shape)}"]
    if len(images) != im.shape[0]:
        out.append(f"{where}: base {b} has {im.shape[0]} image blocks but {len(images)} stored images")
    out += _check_video_groups(infos.get(f"base/{b}/videos"), b, int(im.shape[0]), where)
    out += missing
    for p, (px, pv, pos, st) in images:
        if None in (px, pv, pos, st):
            continue
        if px.dtype != "U8" or len(px.shape) != 3 or px.shape[2] != 3:
            out.append(f"{where}: {p}pixels must be U8 [h, w, 3], got {px.dtype} {list(px.shape)}")
        if pv.dtype != "F64" or len(pv.shape) != 2 or pos.dtype != "I64" or pos.shape != (pv.shape[0], 2):
            out.append(f"{where}: {p}pixel_values must be F64 [P, C] and {p}positions I64 [P, 2]")
        if st.dtype != "F64" or len(st.shape) != 2 or (emb.shape and st.shape[1] != emb.shape[-1]):
            out.append(f"{where}: {p}soft_tokens must be F64 [M, H]")
    return out


def _check_video_groups(info: Any, b: str, n_blocks: int, where: str) -> list[str]:
    """A video base's ``videos``: I64 [v, 2] (first block, frames), each video whole among the base's blocks and
    no two sharing one; none for an image base."""
    if info is None:
        return []
    if info.dtype != "I64" or len(info.shape) != 2 or info.shape[1] != 2 or info.shape[0] < 1:
        return [f"{where}: base/{b}/videos must be I64 [v, 2] (first vision block, frames), got {info.dtype} "
                f"{list(info.shape)}"]
    return []


def _video_frames(fs: "FixtureSet") -> dict[str, set[int]]:
    """Base id -> the indices of its image blocks that are video frames (its stored ``videos`` groups)."""
    return {b: {first + k for first, n in groups for k in range(n)} for b, groups in fs.video_groups().items()}


def _check_image_blocks(fs: "FixtureSet", blocks: Mapping[str, list[tuple[int, int]]],
                        tokens: Mapping[str, np.ndarray], manifest: dict, where: str,
                        what: str = "image") -> list[str]:
    """Each image (audio) block lies in its base, holds only the manifest's image (audio) token, and has
    as many rows as its stored soft tokens."""
    out = []
    section, key = ("images", "image_token_id") if what == "image" else ("audio", "audio_token_id")
    frames = _video_frames(fs) if what == "image" else {}  # video frames are vision blocks of the video token
    token = ((manifest.get(section) or {}).get("token_ids") or {}).get(key)
    video_token = ((manifest.get("videos") or {}).get("token_ids") or {}).get("video_token_id")
    if any(j not in frames.get(b, ()) for b, spans in blocks.items() for j in range(len(spans))) and \
            not isinstance(token, int):
        return [f"{where}: the set has {what} bases but the manifest records no {section}.token_ids.{key}"]
    if frames and not isinstance(video_token, int):
        return [f"{where}: the set has video bases but the manifest records no videos.token_ids.video_token_id"]
    for b, groups in (fs.video_groups().items() if what == "image" else ()):
        taken = [first + k for first, n in groups for k in range(max(n, 0))]
        if any(n < 1 or first < 0 for first, n in groups) or len(set(taken)) != len(taken) or \
                max(taken, default=-1) >= len(blocks.get(b, ())):
            out.append(f"{where}: base/{b}/videos {groups} must name runs of 1 or more of the base's "
                       f"{len(blocks.get(b, ()))} vision blocks, none shared")
    for b, spans in blocks.items():
        ids = tokens[b]
        stored = fs.image_inputs(b) if what == "image" else fs.audio_inputs(b)
        for j, (a, n) in enumerate(spans):
            want, noun = (video_token, "video") if j in frames.get(b, ()) else (token, what)
            if n < 1 or a < 1 or a + n >= len(ids):
                out.append(f"{where}: base {b} {what} block {j} ({a}, {n}) does not lie inside its {len(ids)} tokens")
            elif not np.all(ids[a:a + n] == want):
                out.append(f"{where}: base {b} {what} block {j} ({a}, {n}) holds tokens other than the {noun} token "
                           f"{want}")
            elif j < len(stored) and stored[j]["soft_tokens"].shape[0] != n:
                out.append(f"{where}: base {b} {what} block {j} has {n} tokens but its {what} "
                           f"{stored[j]['soft_tokens'].shape[0]} soft tokens")
    return out


def read_set(path: Path) -> tuple[list[str], FixtureSet | None]:
    """All problems of a set (a directory, or an uncompressed ``.tar`` of one), and the loaded set when
    there are none. The problems of an archive name its members as ``ARCHIVE!member``."""
    path = Path(path)
    if is_archive(path):
        try:
            inner = unpack(path)
        except FixtureError as e:
            return [str(e)], None
        problems, fs = _read_dir(inner)
        return [p.replace(str(inner), f"{path}!") for p in problems], fs
    return _read_dir(path)


def _stored_infos(path: Path, manifest: dict) -> tuple[dict[str, Any], list[str]]:
    """The tensor infos of the set's stored files under their schema 1 names (base/<id>/<leaf>,
    image/<id>/<j>/<leaf>, audio/<id>/<j>/<leaf>), and the problems reading them."""
    if manifest["schema_version"] == 1:
        try:
            return dict(read_header(path / EXPECTED)), []
        except WeightsError as e:
            return {}, [f"{path / EXPECTED}: {e}"]
    infos, problems = {}, []
    for f in manifest["files"]:
        m = BASE_FILE_RE.match(f)
        if not m:
            continue
        b = m.group(1)
        try:
            header = read_header(path / f)
        except WeightsError as e:
            problems.append(f"{path / f}: {e}")
            continue
        for n, info in header.items():
            parts = n.split("/")
            if len(parts) == 3 and parts[0] in ("image", "audio"):
                infos[f"{parts[0]}/{b}/{parts[1]}/{parts[2]}"] = info
            elif len(parts) == 1 and parts[0] in BASE_LEAVES:
                infos[f"base/{b}/{n}"] = info
            else:
                problems.append(f"{path / f}: unexpected tensor '{n}'")
        if f"base/{b}/tokens" not in infos:
            problems.append(f"{path / f}: holds no tokens")
    return infos, problems


def _check_schema2_rows(infos: Mapping[str, Any], b: str, N: int, storage: str, hidden_size: Any,
                        where: str) -> list[str]:
    """A schema 2 base's hidden states and row summaries (and its logits exactly when stored as logits)."""
    out = []
    h = infos.get(f"base/{b}/hidden")
    if h is None or h.dtype != "F64" or len(h.shape) != 2 or h.shape[0] != N or \
            (isinstance(hidden_size, int) and h.shape[1] != hidden_size):
        out.append(f"{where}: base {b} needs hidden as F64 [{N}, {hidden_size}]"
                   + ("" if h is None else f", got {h.dtype} {list(h.shape)}"))
    ids, top = infos.get(f"base/{b}/top_ids"), infos.get(f"base/{b}/top_logits")
    if ids is None or top is None or ids.dtype != "I64" or top.dtype != "F64" or len(ids.shape) != 2 or \
            ids.shape != top.shape or ids.shape[0] != N or ids.shape[1] < 2:
        out.append(f"{where}: base {b} needs top_ids I64 [{N}, k] and top_logits F64 [{N}, k] (k >= 2)")
    for leaf in ("lse", "margin"):
        t = infos.get(f"base/{b}/{leaf}")
        if t is None or t.dtype != "F64" or tuple(t.shape) != (N,):
            out.append(f"{where}: base {b} needs {leaf} as F64 [{N}]")
    if storage == "hidden" and f"base/{b}/logits" in infos:
        out.append(f"{where}: base {b} stores logits, but the set's storage is 'hidden'")
    return out


def _check_mtp_file(path: Path, hidden: Any) -> tuple[dict[str, int], list[str]]:
    """The MTP bases' lengths and the problems of mtp.safetensors (names, dtypes, shapes, finiteness)."""
    try:
        infos = read_header(path)
    except Exception as e:  # noqa: BLE001 - WeightsError naming the problem
        return {}, [f"{path}: {e}"]
    problems, lengths, groups = [], {}, {}
    for n, info in infos.items():
        m = MTP_TENSOR_RE.match(n)
        if m is None:
            problems.append(f"{path}: unexpected tensor '{n}'")
            continue
        groups.setdefault(m.group(1), {})[m.group(2)] = info
    store = TensorStore(path) if not problems else None
    for b, leaves in sorted(groups.items()):
        t = leaves.get("tokens")
        if t is None or t.dtype != "I64" or len(t.shape) != 1 or t.shape[0] < 2:
            problems.append(f"{path}: MTP base {b} needs tokens, a I64 vector of at least 2")
            continue
        lengths[b] = t.shape[0]
        for leaf, info in leaves.items():
            if leaf == "tokens":
                continue
            width = hidden if leaf.endswith("hidden") else None  # a drafter state: the drafter's width
            if info.dtype != "F64" or len(info.shape) != 2 or (isinstance(width, int) and info.shape[1] != width):
                problems.append(f"{path}: {b}/{leaf} must be F64 [rows, {width if isinstance(width, int) else 'H'}], "
                                f"got {info.dtype} {list(info.shape)}")
            elif store is not None and not _all_finite(store.raw(f"{b}/{leaf}")):
                problems.append(f"{path}: {b}/{leaf} holds non-finite values")
        for need in ("prompt_hidden", "verify_hidden"):
            if need not in leaves:
                problems.append(f"{path}: MTP base {b} lacks {need}")
    return lengths, problems


def _manifest_and_files(path: Path) -> tuple[list[str], dict | None]:
    """(problems, the manifest): the manifest read and checked, every file it lists present with its sha256; the
    manifest is None when the set cannot be read further."""
    if not path.is_dir():
        return [f"{path}: not a directory (a fixture set is a directory with {MANIFEST}, or a .tar of one)"], None
    mpath = path / MANIFEST
    try:
        manifest = read_json(mpath)
    except FileNotFoundError:
        return [f"{mpath}: missing; {path} is not a fixture set"], None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return [f"{mpath}: not valid JSON ({e})"], None
    problems = check_manifest(manifest, str(mpath))
    if problems:
        return problems, None
    ok_files = set()
    for f, want in manifest["files"].items():
        fp = path / f
        if not fp.is_file():
            problems.append(f"{fp}: missing (listed in {MANIFEST})")
            continue
        got = sha256_file(fp)
        if got != want:
            problems.append(f"{fp}: sha256 mismatch: {MANIFEST} records {want}, the file has {got} (the file was "
                            "modified, or the manifest was edited)")
        else:
            ok_files.add(f)
    if problems or not (set(SET_FILES) if manifest["schema_version"] == 1 else {CASES}) <= ok_files:
        return problems, None
    return problems, manifest


def _tensors_path(path: Path, manifest: dict) -> Path:
    """Where a set's tensors are named in messages: expected.safetensors (schema 1), else the set."""
    return path / EXPECTED if manifest["schema_version"] < 2 else path


def _base_leaves(infos: dict, v2: bool, epath: Path, problems: list[str]) -> dict[str, set]:
    """{base: its stored leaves}; a problem for each tensor name the format does not know."""
    seen: dict[str, set] = {}
    for n in infos:
        parts = n.split("/")
        if len(parts) == 4 and parts[2].isdigit() and (parts[0], parts[3]) in MEDIA_LEAVES:
            continue  # checked with its base
        if len(parts) != 3 or parts[0] != "base" or parts[2] not in BASE_LEAVES or \
                (not v2 and parts[2] in ("hidden",) + SUMMARY_LEAVES):
            problems.append(f"{epath}: unexpected tensor '{n}'")
            continue
        seen.setdefault(parts[1], set()).add(parts[2])
    return seen


def _stored_bases(path: Path, manifest: dict, infos: dict, problems: list[str]) -> tuple[dict[str, int], int | None]:
    """({base: its length}, the vocabulary size): every base's tensors checked by shape and type."""
    v2 = manifest["schema_version"] >= 2
    storage = manifest.get("storage", "logits")
    epath = _tensors_path(path, manifest)
    seen = _base_leaves(infos, v2, epath, problems)
    config = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    vocab = None
    if v2 and storage == "hidden":
        vocab = config.get("vocab_size")
        if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 2:
            problems.append(f"{path / MANIFEST}: config.vocab_size must be an integer (a set stored as hidden "
                            "states needs it)")
            vocab = None
    lengths: dict[str, int] = {}
    for b in sorted(seen):
        where = str(path / f"base-{b}.safetensors") if v2 else str(epath)
        t, lg = infos.get(f"base/{b}/tokens"), infos.get(f"base/{b}/logits")
        if t is None or (lg is None and storage == "logits"):
            problems.append(f"{where}: base {b} needs both tokens and logits")
            continue
        if t.dtype != "I64" or len(t.shape) != 1 or t.shape[0] < 1:
            problems.append(f"{where}: base/{b}/tokens must be a non-empty I64 vector, got {t.dtype} {list(t.shape)}")
            continue
        if v2:
            problems += _check_schema2_rows(infos, b, t.shape[0], storage, config.get("hidden_size"), where)
        if storage == "logits":
            if lg.dtype != "F64" or lg.shape[:1] != t.shape or len(lg.shape) != 2:
                problems.append(f"{where}: base/{b}/logits must be F64 [{t.shape[0]}, V], got {lg.dtype} "
                                f"{list(lg.shape)}")
                continue
            if vocab is None:
                vocab = lg.shape[1]
            elif lg.shape[1] != vocab:
                problems.append(f"{where}: base/{b}/logits has {lg.shape[1]} columns, other bases {vocab}")
        rm = infos.get(f"base/{b}/router_margin")
        if rm is not None and (rm.dtype != "F64" or rm.shape != t.shape):
            problems.append(f"{epath}: base/{b}/router_margin must be F64 [{t.shape[0]}]")
        problems += _check_image_tensors(infos, b, t.shape[0], str(epath))
        lengths[b] = t.shape[0]
    if v2 and MTP_FILE in manifest["files"]:
        mtp_lengths, mtp_problems = _check_mtp_file(path / MTP_FILE, config.get("hidden_size"))
        problems += mtp_problems
        lengths.update(mtp_lengths)
    _check_declared(manifest, lengths, epath, problems)
    return lengths, vocab


def _check_declared(manifest: dict, lengths: dict[str, int], epath: Path, problems: list[str]) -> None:
    """The bases the manifest declares are the bases stored, at the declared lengths."""
    if not lengths:
        problems.append(f"{epath}: holds no base")
    declared = manifest.get("bases")
    if isinstance(declared, dict):
        for b, d in declared.items():
            if b not in lengths:
                problems.append(f"{epath}: base {b} of {MANIFEST} is not stored")
            elif isinstance(d, dict) and d.get("length") not in (None, lengths[b]):
                problems.append(f"{epath}: base {b} has {lengths[b]} tokens, {MANIFEST} says {d.get('length')}")


def _stored_values(fs: FixtureSet, vocab: int | None, epath: Path, problems: list[str]) -> tuple[dict, dict]:
    """(tokens, media blocks) of every base, their values checked: ids in the vocabulary, media blocks where the
    media tokens are, every stored float finite."""
    v2 = fs.manifest["schema_version"] >= 2
    tokens = fs.bases()
    for b, ids in tokens.items():
        if vocab is not None and (ids.min() < 0 or ids.max() >= vocab):
            problems.append(f"{epath}: base/{b}/tokens holds ids outside the vocabulary [0, {vocab})")
    blocks = fs.image_blocks()
    problems += _check_image_blocks(fs, blocks, tokens, fs.manifest, str(epath))
    audio_blocks = fs.audio_blocks()
    problems += _check_image_blocks(fs, audio_blocks, tokens, fs.manifest, str(epath), "audio")
    storage = fs.manifest.get("storage", "logits")
    stored = {"logits": fs.base_logits() if storage == "logits" else {}, "hidden": fs.hidden_states(),
              **({leaf: fs.stored(leaf) for leaf in ("top_logits", "lse")} if v2 else {})}
    for leaf, arrays in stored.items():
        for b, a in arrays.items():
            if not _all_finite(a):
                problems.append(f"{epath}: base/{b}/{leaf} holds non-finite values")
    if v2 and vocab is not None:
        for b, ids in fs.stored("top_ids").items():
            if np.asarray(ids).size and (np.min(ids) < 0 or np.max(ids) >= vocab):
                problems.append(f"{epath}: base/{b}/top_ids holds ids outside the vocabulary [0, {vocab})")
    return tokens, {**blocks, **audio_blocks}


def _read_cases(path: Path, manifest: dict, lengths: dict[str, int], blocks: dict, tokens: dict,
                problems: list[str]) -> list[Case] | None:
    """cases.json's cases, each checked against the stored bases (None: the file cannot be read at all)."""
    cpath = path / CASES
    try:
        doc = read_json(cpath)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        problems.append(f"{cpath}: not valid JSON ({e})")
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("cases"), list):
        problems.append(f"{cpath}: must be an object with a 'cases' list")
        return None
    cases: list[Case] = []
    for k, d in enumerate(doc["cases"]):
        try:
            cases.append(Case.from_json(d))
        except ValueError as e:
            problems.append(f"{cpath}: case {k}: {e}")
    ids = [c.id for c in cases]
    dups = sorted({i for i in ids if ids.count(i) > 1})
    if dups:
        problems.append(f"{cpath}: duplicate case id {dups[0]}")
    prefix = f"{manifest['name']}/"
    for c in cases:
        if not c.id.startswith(prefix):
            problems.append(f"{cpath}: case id {c.id} does not start with the set name '{prefix}'")
        problems += [f"{cpath}: {p}" for p in check_case(c, lengths, blocks)]
        if c.generation and tokens and not check_case(c, lengths, blocks):
            want = tuple(int(t) for t in tokens[c.base][c.length:c.length + c.decode_len + 1])
            if tuple(c.golden_tokens) != want:
                problems.append(f"{cpath}: case {c.id}: golden tokens {list(c.golden_tokens)} are not "
                                f"base {c.base}[{c.length}:{c.length + c.decode_len + 1}] = {list(want)}")
    if isinstance(manifest.get("cases"), int) and manifest["cases"] != len(cases):
        problems.append(f"{cpath}: holds {len(cases)} cases, {MANIFEST} says {manifest['cases']}")
    return cases


def _read_dir(path: Path) -> tuple[list[str], FixtureSet | None]:
    """(problems, the set): the manifest and its files, the stored tensors, their values, the cases; the set is
    None when anything is wrong."""
    problems, manifest = _manifest_and_files(path)
    if manifest is None:
        return problems, None
    infos, unreadable = _stored_infos(path, manifest)
    if unreadable:
        return problems + unreadable, None
    lengths, vocab = _stored_bases(path, manifest, infos, problems)
    fs = FixtureSet(path=path, manifest=manifest, cases=[])
    tokens: dict = {}
    blocks: dict = {}
    if not problems:
        tokens, blocks = _stored_values(fs, vocab, _tensors_path(path, manifest), problems)
    cases = _read_cases(path, manifest, lengths, blocks, tokens, problems)
    if cases is None or problems:
        return problems, None
    fs.cases = cases
    return problems, fs


def _all_finite(a: np.ndarray) -> bool:
    """np.isfinite over a (possibly memory-mapped) array, a block of rows at a time."""
    step = max(1, (1 << 26) // max(1, int(np.prod(a.shape[1:])) * 8))
    return all(bool(np.all(np.isfinite(a[s:s + step]))) for s in range(0, a.shape[0], step))


def load_set(path: str | Path) -> FixtureSet:
    """Load a set after verifying its schema and the sha256 of every file (FixtureError naming the file)."""
    problems, fs = read_set(Path(path))
    if problems:
        more = f" (and {len(problems) - 1} more problem(s); run `conformance verify`)" if len(problems) > 1 else ""
        raise FixtureError(problems[0] + more)
    assert fs is not None
    return fs




def checked_set(path: str | Path, *, model: str | Path | None = None,
                rehash: bool = False) -> tuple[list[str], FixtureSet | None]:
    """Every problem of a set (empty list = ok), and the set when there are none: schema, sha256 of every
    file, cases against bases, tensor shapes, and for an external set the size and sha256 of every
    checkpoint file it records, in ``model`` (``--model``; synthetic sets ignore it) or else at the recorded
    path. An external set without ``model`` whose recorded path is not there is not a problem: its
    checkpoint is not checked, and ``fs.warnings`` says so (``checkpoint.not_checked_note``). Never raises
    for content problems."""
    try:
        problems, fs = read_set(Path(path))
        if not problems:
            rec = fs.model_record
            if rec["kind"] == "external" and model is None and recorded_dir(rec) is None:
                fs.warnings.append(not_checked_note(rec))
            elif rec["kind"] == "external":
                problems = fs.checkpoint_problems(model=model, rehash=rehash)
    except Exception as e:  # noqa: BLE001 - verify reports, it does not raise
        return [f"{path}: cannot be verified: {type(e).__name__}: {e}"], None
    return problems, (None if problems else fs)


def check_set(path: str | Path) -> list[str]:
    """The problems of ``checked_set``."""
    return checked_set(path)[0]
