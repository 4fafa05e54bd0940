"""Download WikiHow (wikihowAll.csv and the authors' split lists) into a data folder.

    python scripts/download_wikihow.py --data_dir data

The split lists come from the authors' GitHub repository. wikihowAll.csv is on Box: the tutorial's link
is a web page, not the file, so unless ``--csv_url`` points at the file itself this script stops with
the manual steps instead of saving the page as CSV. Every file is written under a temporary name and
renamed when complete, so an interrupted download never leaves a partial file under the final name.
Files already present are kept unless ``--force``.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

# Run as `python scripts/download_wikihow.py`: sys.path[0] is scripts/, the package is its parent.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from configs.errors import UserError  # noqa: E402
from utils.base.files import atomic_path  # noqa: E402
from utils.base.log import get_logger, progress_bar, setup_logging  # noqa: E402
from utils.data.sources import WIKIHOW_CSV, WIKIHOW_CSV_URL  # noqa: E402
from utils.data.wikihow import SPLIT_FILES, check_csv_header  # noqa: E402

SPLIT_LIST_BASE_URL = "https://raw.githubusercontent.com/mahnazkoupaee/WikiHow-Dataset/master/"
_CHUNK_BYTES = 1 << 20
_TIMEOUT_S = 60
# Some servers refuse urllib's default agent string.
_USER_AGENT = "Mozilla/5.0 (compatible; t5-fsdp-wikihow-downloader)"


class DownloadError(UserError):
    """A download that cannot give the file asked for (network error, a web page instead of the file)."""


@dataclass
class Response:
    """What the rest of the script needs of an HTTP response (tests serve it from memory)."""

    content_type: str
    length: int | None
    stream: BinaryIO


def open_url(url: str) -> Response:
    """Open ``url`` for reading; the one function that touches the network."""
    request = urllib.request.Request(url, headers={"User-Agent": _USER_AGENT})
    try:
        stream = urllib.request.urlopen(request, timeout=_TIMEOUT_S)  # noqa: S310 - https URLs we chose
    except OSError as exc:  # URLError and HTTPError are OSErrors
        raise DownloadError(f"Cannot download {url}: {exc}") from exc
    length = stream.headers.get("Content-Length")
    return Response(
        content_type=stream.headers.get("Content-Type", ""),
        length=int(length) if length and length.isdigit() else None,
        stream=stream,
    )


def looks_like_html(content_type: str, first_bytes: bytes) -> bool:
    """True for a web page: by its Content-Type, or by how it starts when the type is wrong or missing."""
    if "html" in content_type.lower():
        return True
    start = first_bytes.lstrip()[:64].lower()
    return start.startswith((b"<!doctype html", b"<html", b"<head", b"<?xml"))


def _manual_csv_steps(url: str, data_dir: Path) -> str:
    return (
        f"{url} returned a web page, not {WIKIHOW_CSV} (the Box link is a page to download from). Download "
        f"it by hand: open {url} in a browser, download {WIKIHOW_CSV}, and put it in {data_dir.resolve()} "
        f"(or pass --csv_url with a direct link to the file)."
    )


def download(
    url: str, dest: Path, *, refuse_html: bool = False, check: Callable[[Path], None] | None = None
) -> None:
    """Download ``url`` to ``dest`` atomically: a temporary name in the same folder, renamed when done.

    ``refuse_html``: stop with the manual steps if the server sends a web page. ``check(path)`` runs on
    the complete temporary file before the rename; if it raises, nothing is left under ``dest``.
    """
    try:
        # utils.base.files.atomic_path: a temporary sibling (same file system, so the rename is atomic), removed
        # on any failure, Ctrl-C included.
        with atomic_path(dest) as tmp:
            with open(tmp, "wb") as out:
                response = open_url(url)
                refusal = (lambda: _manual_csv_steps(url, dest.parent)) if refuse_html else None
                _stream(response, out, dest.name, refusal)
                out.flush()
                os.fsync(out.fileno())
            size = os.path.getsize(tmp)
            if response.length is not None and size != response.length:
                raise DownloadError(f"Download of {url} ended early: {size} of {response.length} bytes.")
            if check is not None:
                check(Path(tmp))
    except OSError as exc:
        # A dropped connection, a full disk: say which file, without a traceback.
        if isinstance(exc, UserError):
            raise
        raise DownloadError(f"Download of {url} to {dest} failed: {exc}") from exc


def _stream(response: Response, out: BinaryIO, name: str, html_refusal: Callable[[], str] | None) -> None:
    """Copy the response body to `out` with a progress bar (log lines where no terminal shows one); a web page
    instead of data is refused."""
    with response.stream as stream, progress_bar(response.length, name, unit="B") as bar:
        first = True
        while chunk := stream.read(_CHUNK_BYTES):
            if first and html_refusal and looks_like_html(response.content_type, chunk):
                raise DownloadError(html_refusal())
            first = False
            out.write(chunk)
            bar.update(len(chunk))


def fetch(
    url: str,
    dest: Path,
    *,
    force: bool,
    refuse_html: bool = False,
    check: Callable[[Path], None] | None = None,
) -> bool:
    """Download unless ``dest`` exists (and not ``force``); True if it downloaded."""
    if dest.exists() and not force:
        get_logger().info("%s already exists, kept (--force downloads it again).", dest)
        return False
    get_logger().info("Downloading %s -> %s", url, dest)
    download(url, dest, refuse_html=refuse_html, check=check)
    return True


def download_wikihow(data_dir: Path, csv_url: str = WIKIHOW_CSV_URL, force: bool = False) -> None:
    """The split lists first (small, always direct), then wikihowAll.csv, whose header is checked."""
    data_dir.mkdir(parents=True, exist_ok=True)
    for file_name in SPLIT_FILES.values():
        fetch(SPLIT_LIST_BASE_URL + file_name, data_dir / file_name, force=force)
    csv_path = data_dir / WIKIHOW_CSV
    fetch(csv_url, csv_path, force=force, refuse_html=True, check=check_csv_header)
    # A file that was already there is checked too: it may be a page saved by hand, or another CSV.
    check_csv_header(csv_path)
    get_logger().info("WikiHow is ready in %s", data_dir.resolve())


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", type=Path, default=Path("data"), help="folder to download into")
    parser.add_argument("--csv_url", default=WIKIHOW_CSV_URL, help="where to download wikihowAll.csv from")
    parser.add_argument("--force", action="store_true", help="download files that already exist again")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logger = setup_logging()
    try:
        download_wikihow(args.data_dir, args.csv_url, args.force)
    except UserError as exc:
        logger.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
