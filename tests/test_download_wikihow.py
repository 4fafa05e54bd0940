"""scripts/download_wikihow.py with the network replaced by bytes served from memory."""

from __future__ import annotations

import importlib.util
import io
import sys
from pathlib import Path

import pytest

from configs.errors import DataError
from utils.base.log import get_logger

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "download_wikihow.py"
GOOD_CSV = b'headline,title,text\nMix.,How to Mix,"Put everything in a bowl and stir."\n'
BOX_PAGE = b"<!DOCTYPE html>\n<html><head><title>Box</title></head><body>wikihowAll.csv</body></html>\n"


@pytest.fixture
def script(monkeypatch):
    # main() configures the package logger for the command line; give later tests the logger back.
    logger = get_logger()
    saved = (list(logger.handlers), logger.level, logger.propagate)
    spec = importlib.util.spec_from_file_location("download_wikihow", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    # Registered while it runs: dataclasses look their module up in sys.modules.
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    yield module
    logger.handlers[:], logger.level, logger.propagate = saved


class _BrokenStream(io.BytesIO):
    """Serves its bytes once, then the connection drops."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self._served = False

    def read(self, size: int = -1) -> bytes:
        if self._served:
            raise ConnectionResetError("connection reset by peer")
        self._served = True
        return super().read(size)


def serve(monkeypatch, script, pages: dict[str, tuple[str, bytes]], broken: bool = False) -> list[str]:
    """Replace the network by ``pages`` (url -> (content type, body)); returns the URLs asked for."""
    asked: list[str] = []

    def open_url(url: str):
        asked.append(url)
        content_type, body = pages[url]
        stream = _BrokenStream(body) if broken else io.BytesIO(body)
        # A broken download announces more bytes than it delivers.
        return script.Response(content_type, len(body) * (2 if broken else 1), stream)

    monkeypatch.setattr(script, "open_url", open_url)
    return asked


def test_download_is_atomic(tmp_path, monkeypatch, script):
    url, dest = "https://example.org/all_val.txt", tmp_path / "all_val.txt"
    serve(monkeypatch, script, {url: ("text/plain", b"HowtoVote\n")}, broken=True)
    with pytest.raises(script.DownloadError, match="failed"):
        script.fetch(url, dest, force=False)
    assert list(tmp_path.iterdir()) == []  # no partial file, under the final name or a temporary one

    serve(monkeypatch, script, {url: ("text/plain", b"HowtoVote\n")})
    assert script.fetch(url, dest, force=False)
    assert dest.read_bytes() == b"HowtoVote\n"
    assert list(tmp_path.iterdir()) == [dest]


def test_skips_present_files_unless_forced(tmp_path, monkeypatch, script):
    url, dest = "https://example.org/all_val.txt", tmp_path / "all_val.txt"
    dest.write_bytes(b"old\n")
    asked = serve(monkeypatch, script, {url: ("text/plain", b"new\n")})
    assert not script.fetch(url, dest, force=False)
    assert asked == [] and dest.read_bytes() == b"old\n"
    assert script.fetch(url, dest, force=True)
    assert asked == [url] and dest.read_bytes() == b"new\n"


def _pages(script, csv_url: str, csv_page: tuple[str, bytes]) -> dict[str, tuple[str, bytes]]:
    lists = {
        script.SPLIT_LIST_BASE_URL + name: ("text/plain", b"HowtoMix\n")
        for name in ("all_train.txt", "all_val.txt", "all_test.txt")
    }
    return {**lists, csv_url: csv_page}


@pytest.mark.parametrize("content_type", ["text/html; charset=utf-8", "application/octet-stream"])
def test_refuses_a_web_page_as_csv(tmp_path, monkeypatch, script, content_type):
    serve(monkeypatch, script, _pages(script, script.WIKIHOW_CSV_URL, (content_type, BOX_PAGE)))
    with pytest.raises(script.DownloadError) as info:
        script.download_wikihow(tmp_path)
    message = str(info.value)
    assert "browser" in message and "wikihowAll.csv" in message and str(tmp_path.resolve()) in message
    # The lists are kept; no CSV (not even a temporary one) is left.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["all_test.txt", "all_train.txt", "all_val.txt"]
    # The command line reports it as one error line and a non-zero status.
    assert script.main(["--data_dir", str(tmp_path)]) == 1


def test_csv_header_is_checked(tmp_path, monkeypatch, script):
    csv_url = "https://example.org/wikihowAll.csv"
    serve(monkeypatch, script, _pages(script, csv_url, ("text/csv", b"title,headline,text\n")))
    with pytest.raises(DataError, match="original wikihowAll.csv"):
        script.download_wikihow(tmp_path, csv_url)
    assert not (tmp_path / "wikihowAll.csv").exists()

    serve(monkeypatch, script, _pages(script, csv_url, ("text/csv", GOOD_CSV)))
    script.download_wikihow(tmp_path, csv_url)
    assert (tmp_path / "wikihowAll.csv").read_bytes() == GOOD_CSV
