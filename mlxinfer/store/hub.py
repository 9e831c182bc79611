"""The Hub side of ``pull``: a revision resolved to a commit, the commit's file list (checked:
sizes that fit, paths inside the repo), the files a model needs, and downloads that resume.

Metadata comes through ``huggingface_hub`` (``HfApi``: its endpoint, token and errors); the
bytes through our own ranged GET of each file's ``resolve`` URL, appended to ``<file>.part`` and
renamed when whole, so a killed pull resumes where it stopped (huggingface_hub 2.x restarts a
file from zero). Every file is checked against the Hub's own hash before it is kept: the LFS
SHA-256, else the git blob id.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Callable

from ..files.atomic import fsync_path
from .names import StoreError

MAX_FILE_BYTES = 1 << 46  # 64 TiB: a size past it is the Hub answering nonsense, not a file
TIMEOUT_S = 30.0  # connect and per-read; a Hub silent this long is an error, not a hang
_COMMIT = re.compile(r"[0-9a-f]{40}\Z")
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
WEIGHTS = ("*.safetensors",)
# What a model needs besides weights: config, tokenizer, chat template, processor, generation.
SMALL = ("*.json", "tokenizer.model", "*.jinja", "*.tiktoken", "*.txt")
_ST_FOLDER = re.compile(r"\d+_[A-Za-z]+\Z")  # sentence-transformers' 1_Pooling/ and the like


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int
    sha256: str | None  # the LFS object's, when the file is in LFS
    blob_id: str | None  # the git blob id otherwise


@dataclass(frozen=True)
class Remote:
    repo: str
    commit: str
    files: tuple[RemoteFile, ...]
    license: str | None = None
    gated: bool = False


def _hub_error(repo: str, e: Exception) -> StoreError:
    from huggingface_hub.errors import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(e, GatedRepoError):
        return StoreError(
            f"{repo}: a gated repo: accept its licence at https://huggingface.co/{repo} and set "
            "HF_TOKEN to a token of that account"
        )
    if isinstance(e, RevisionNotFoundError):
        return StoreError(f"{repo}: no such revision on the Hub ({_first_line(e)})")
    if isinstance(e, RepositoryNotFoundError):
        return StoreError(
            f"{repo}: no such repo on the Hub (a private one needs HF_TOKEN): {_first_line(e)}"
        )
    return StoreError(f"{repo}: the Hub cannot be reached or refused ({type(e).__name__}: "
                      f"{_first_line(e)})")  # fmt: skip


def network_errors() -> tuple[type[BaseException], ...]:
    """What a request that fails on the way raises: httpx's (ours), httpx2's (huggingface_hub
    2.x's own client), OSError."""
    import httpx

    found: list[type[BaseException]] = [httpx.HTTPError, OSError]
    try:
        import httpx2

        found.append(httpx2.HTTPError)
    except ImportError:  # huggingface_hub < 2 uses httpx (or requests: its errors are OSErrors)
        pass
    return tuple(found)


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def resolve(
    repo: str, revision: str | None, *, endpoint: str | None, token: str | bool | None
) -> Remote:
    """The commit ``revision`` (default ``main``) of ``repo`` and its files, checked."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.hf_api import RepoFile

    if constants.HF_HUB_OFFLINE:
        raise StoreError(f"{repo}: HF_HUB_OFFLINE is set; pull needs the Hub")
    api = HfApi(endpoint=endpoint, token=token)
    try:
        info = api.model_info(repo, revision=revision, timeout=TIMEOUT_S)
        commit = info.sha
        if not isinstance(commit, str) or not _COMMIT.match(commit):
            raise StoreError(f"{repo}: the Hub answered commit {commit!r}, expected 40 hex digits")
        entries = [
            RepoFile(**e) if e.get("type") == "file" else None
            for e in _tree(api.endpoint, repo, commit, api._build_hf_headers(token=token))
        ]
    except (HfHubHTTPError, *network_errors(), ValueError) as e:
        raise _hub_error(repo, e) from None
    except (KeyError, TypeError, AttributeError) as e:  # a listing without the fields it needs
        raise StoreError(
            f"{repo}: the Hub's answer is malformed ({type(e).__name__}: {e})"
        ) from None
    files = []
    for entry in entries:
        if entry is None:  # a folder
            continue
        path, size = checked_path(repo, entry.path), entry.size
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_FILE_BYTES:
            raise StoreError(
                f"{repo}: the Hub lists {path!r} with size {size!r}, expected 0..{MAX_FILE_BYTES}"
            )
        sha = entry.lfs.sha256 if entry.lfs is not None else None
        if sha is not None and not _HEX64.match(str(sha)):
            raise StoreError(f"{repo}: the Hub lists {path!r} with LFS SHA-256 {sha!r}")
        files.append(RemoteFile(path, size, sha, entry.blob_id))
    card = getattr(info, "card_data", None)
    license = getattr(card, "license", None) if card is not None else None
    return Remote(repo, commit, tuple(files), license if isinstance(license, str) else None,
                  bool(getattr(info, "gated", False)))  # fmt: skip


MAX_PAGES = 1000  # of the Hub's 1,000 entries each
MAX_PAGE_BYTES = 64 << 20


def _tree(endpoint: str, repo: str, commit: str, headers: dict) -> list[dict]:
    """``GET /api/models/{repo}/tree/{commit}?recursive=true``, page after page (the ``Link``
    header's ``next``), each request bounded by :data:`TIMEOUT_S` and each page by
    :data:`MAX_PAGE_BYTES` (huggingface_hub's ``list_repo_tree`` waits without a limit)."""
    import httpx
    from huggingface_hub.utils import hf_raise_for_status

    url: str | None = f"{endpoint}/api/models/{repo}/tree/{commit}"
    params: dict | None = {"recursive": "true", "expand": "false"}
    entries: list[dict] = []
    timeout = httpx.Timeout(TIMEOUT_S)
    with httpx.Client(follow_redirects=True, timeout=timeout, headers=headers) as client:
        for _ in range(MAX_PAGES):
            with client.stream("GET", url, params=params) as r:
                if r.status_code >= 400:  # huggingface_hub's errors (gated, not found...)
                    r.read()
                    hf_raise_for_status(r)
                body = bytearray()
                for chunk in r.iter_bytes():
                    body += chunk
                    if len(body) > MAX_PAGE_BYTES:
                        raise StoreError(
                            f"{repo}: the Hub's file listing passed {MAX_PAGE_BYTES} bytes a page"
                        )
            page = json.loads(body)
            if not isinstance(page, list) or not all(isinstance(e, dict) for e in page):
                raise StoreError(f"{repo}: the Hub's file listing is not a list of entries")
            entries.extend(page)
            url, params = r.links.get("next", {}).get("url"), None
            if url is None:
                return entries
    raise StoreError(f"{repo}: the Hub's file listing runs past {MAX_PAGES} pages")


def checked_path(repo: str, path: object) -> str:
    """A file path the Hub listed, if it stays inside the repo (relative, no ``..``, no
    backslash or NUL); else a StoreError."""
    ok = isinstance(path, str) and path and "\\" not in path and "\0" not in path
    parts = PurePosixPath(path).parts if ok else ()
    if not ok or path.startswith("/") or any(p in ("..", ".", "") for p in path.split("/")):
        raise StoreError(f"{repo}: the Hub lists the file {path!r}, outside the repo")
    return "/".join(parts)


def gguf_variants(remote: Remote) -> dict[str, RemoteFile]:
    """A GGUF repo's quants by name (``Q4_K_M`` from ``model-Q4_K_M.gguf``), upper case."""
    found = {}
    for f in remote.files:
        if f.path.lower().endswith(".gguf") and "/" not in f.path:
            m = re.search(r"[-._]((?:[IUBF]?[QF]\d+|BF16|F16|F32|IQ\d)[A-Z0-9_]*)\.gguf$",
                          f.path, re.IGNORECASE)  # fmt: skip
            found[(m.group(1) if m else PurePosixPath(f.path).stem).upper()] = f
    return found


def needed_files(remote: Remote, variant: str | None) -> tuple[str, list[RemoteFile]]:
    """(kind, files): ``"gguf"`` and the one quant ``variant`` names (default Q4_K_M, or the
    only one); else ``"hf"`` (or ``"mlx"`` once config.json is read) and the weights, config,
    tokenizer and processor files."""
    variants = gguf_variants(remote)
    if variants:
        names = ", ".join(sorted(variants))
        if variant is not None:
            want = variant.upper()
        elif "Q4_K_M" in variants or len(variants) == 1:
            want = "Q4_K_M" if "Q4_K_M" in variants else next(iter(variants))
        else:
            raise StoreError(
                f"{remote.repo}: several GGUF quants and no Q4_K_M (the default); name one of "
                f"{names} (as {remote.repo}:{sorted(variants)[0]})"
            )
        if want not in variants:
            raise StoreError(
                f"{remote.repo}: no GGUF quant {want!r}; expected one of {names} "
                f"(as {remote.repo}:{sorted(variants)[0]})"
            )
        return "gguf", [variants[want]]
    if variant is not None:
        raise StoreError(
            f"{remote.repo}:{variant}: a variant names a GGUF quant, but the repo has no .gguf "
            f"files; pull {remote.repo}"
        )
    chosen = [f for f in remote.files if _wanted(f.path)]
    weights = [f for f in chosen if f.path.endswith(".safetensors")]
    if len(weights) > 1:  # Mistral's repos hold consolidated.safetensors beside the HF shards
        chosen = [f for f in chosen if f.path != "consolidated.safetensors"]
    if not weights:
        raise StoreError(
            f"{remote.repo}: no *.safetensors or *.gguf weights at {remote.commit[:12]} "
            "(mlxinfer never unpickles .bin/.pt weights)"
        )
    if not any(f.path == "config.json" for f in chosen):
        raise StoreError(f"{remote.repo}: no config.json at {remote.commit[:12]}")
    return "hf", chosen


def _wanted(path: str) -> bool:
    folder, _, name = path.rpartition("/")
    if folder and not (_ST_FOLDER.match(folder) and name.endswith(".json")):
        return False
    return any(fnmatch.fnmatch(name, p) for p in (*WEIGHTS, *SMALL))


def missing_bytes(files: list[RemoteFile], dest: Path) -> int:
    """Bytes still to download into ``dest`` (whole files count 0, ``.part`` files their rest)."""
    total = 0
    for f in files:
        if (dest / f.path).is_file():
            continue
        part = dest / (f.path + ".part")
        have = part.stat().st_size if part.is_file() else 0
        total += max(f.size - have, 0) if have <= f.size else f.size
    return total


def reuse_cached(remote: Remote, files: list[RemoteFile], dest: Path, hf_cache: Path) -> list[str]:
    """Link into ``dest`` the files the Hugging Face cache already holds (its blobs are named by
    the LFS SHA-256 or the git blob id), each checked against the listing first, so a model
    another app downloaded is not downloaded again. Returns their paths."""
    blobs = hf_cache / f"models--{remote.repo.replace('/', '--')}" / "blobs"
    used = []
    for f in files:
        key, target = f.sha256 or f.blob_id, dest / f.path
        blob = blobs / key if key and re.fullmatch(r"[0-9a-f]{40,64}", key) else None
        if target.is_file() or blob is None or not blob.is_file():
            continue
        if blob.stat().st_size != f.size or _hash_problem(blob, f) is not None:
            continue  # not the listed file: downloaded instead
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(blob, target)  # read only; the cache's file is never written
        except OSError:
            shutil.copyfile(blob, target)
        used.append(f.path)
    return used


def download(
    remote: Remote,
    files: list[RemoteFile],
    dest: Path,
    *,
    endpoint: str | None,
    token: str | bool | None,
    progress: Callable[[str, int, int], None],
) -> None:
    """Each of ``files`` into ``dest`` (``progress("downloading weights", bytes, total)``),
    resuming ``.part`` files; a file whose bytes or hash differ from the listing is an error."""
    import httpx
    from huggingface_hub import constants, hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    total = sum(f.size for f in files)
    done = sum(f.size for f in files if (dest / f.path).is_file())
    progress("downloading weights", done, total)
    headers = build_hf_headers(token=token)
    timeout = httpx.Timeout(TIMEOUT_S)
    with httpx.Client(follow_redirects=True, timeout=timeout, headers=headers) as client:
        for f in files:
            target = dest / f.path
            if target.is_file():
                continue
            url = hf_hub_url(remote.repo, f.path, revision=remote.commit,
                             endpoint=endpoint or constants.ENDPOINT)  # fmt: skip
            done = _fetch(client, remote, f, target, url, done, total, progress)
    progress("downloading weights", total, total)


def _fetch(client, remote: Remote, f: RemoteFile, target: Path, url: str, done: int, total: int,
           progress) -> int:  # fmt: skip

    part = target.with_name(target.name + ".part")
    part.parent.mkdir(parents=True, exist_ok=True)
    have = part.stat().st_size if part.is_file() else 0
    if have > f.size:  # not this file's beginning
        part.unlink()
        have = 0
    start = done
    try:
        if have < f.size or f.size == 0:
            ranged = {"Range": f"bytes={have}-"} if have else {}
            with client.stream("GET", url, headers=ranged) as r:
                if r.status_code in (401, 403):
                    raise StoreError(
                        f"{remote.repo}: the Hub refused {f.path} (HTTP {r.status_code}): a gated "
                        "or private repo needs HF_TOKEN, with its licence accepted at "
                        f"https://huggingface.co/{remote.repo}"
                    )
                if r.status_code == 200 and have:  # the server ignored the Range: start over
                    have = 0
                elif r.status_code not in (200, 206):
                    raise StoreError(f"{remote.repo}: GET {f.path}: HTTP {r.status_code}")
                with open(part, "r+b" if have else "wb") as out:
                    out.seek(have)
                    out.truncate()
                    for (
                        chunk
                    ) in r.iter_bytes():  # as it arrives (a sized chunker would hold it back)
                        have += len(chunk)
                        if have > f.size:  # not the file listed: not kept to resume
                            part.unlink()
                            raise StoreError(
                                f"{remote.repo}: {f.path}: the Hub sent more than the "
                                f"{f.size} bytes it listed"
                            )
                        out.write(chunk)
                        progress("downloading weights", min(start + have, total), total)
                    out.flush()
                    os.fsync(out.fileno())
    except network_errors() as e:
        raise StoreError(
            f"{remote.repo}: downloading {f.path} stopped at {have} of {f.size} bytes "
            f"({type(e).__name__}: {_first_line(e)}); pull again to resume"
        ) from None
    if have != f.size:
        raise StoreError(
            f"{remote.repo}: {f.path}: {have} bytes received, the Hub listed {f.size}; "
            "pull again to resume"
        )
    if (problem := _hash_problem(part, f)) is not None:
        part.unlink()
        raise StoreError(f"{remote.repo}: {f.path}: {problem}; the download was discarded")
    os.replace(part, target)
    fsync_path(target.parent)
    return start + f.size


def _hash_problem(path: Path, f: RemoteFile) -> str | None:
    if f.sha256 is not None:
        h, expected, what = hashlib.sha256(), f.sha256, "SHA-256"
    elif f.blob_id is not None and re.fullmatch(r"[0-9a-f]{40}", f.blob_id):
        h, expected, what = hashlib.sha1(f"blob {f.size}\0".encode()), f.blob_id, "git blob id"
    else:
        return None
    with open(path, "rb") as src:
        while chunk := src.read(1 << 20):
            h.update(chunk)
    found = h.hexdigest()
    return None if found == expected else f"{what} {found}, the Hub listed {expected}"
