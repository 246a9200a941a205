"""Shared rendering helpers: stdout carries results (one JSON document with --json), stderr the rest."""

from __future__ import annotations

import json
import logging
from typing import Any

import click


class StorePath(click.ParamType):
    """A cache location, checked by the library's one rule for where caches may live."""

    name = "PATH"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from dlstore.errors import DlstoreError
        from dlstore.storage.stores import parse_store_path

        try:
            return parse_store_path(value)
        except DlstoreError as e:
            self.fail(str(e), param, ctx)


class JsonObject(click.ParamType):
    """A JSON object given on the command line (e.g. ``--storage-options '{"anon": true}'``)."""

    name = "JSON"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, dict):
            return value
        try:
            doc = json.loads(value)
        except ValueError as e:
            self.fail(f"not valid JSON ({e})", param, ctx)
        if not isinstance(doc, dict):
            self.fail('expected a JSON object such as {"anon": true}', param, ctx)
        return doc


STORAGE_OPTIONS_HELP = (
    "For a URL cache path: fsspec options as a JSON object (endpoint_url, key, secret, profile, ...); "
    "default: the store's standard environment. Never logged or stored."
)


def storage_options_option() -> Any:
    return click.option("--storage-options", type=JsonObject(), default=None, help=STORAGE_OPTIONS_HELP)


def emit_json(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=1, default=str))


class _StderrHandler(logging.Handler):
    """Writes to the stderr of the moment (``click.echo(err=True)``), not the stream there was at set-up: a
    test's CliRunner swaps it per invocation."""

    def emit(self, record: logging.LogRecord) -> None:
        click.echo(f"[dlstore] {self.format(record)}", err=True)


def show_library_log() -> None:
    """The library says what a long step is doing through the ``dlstore`` logger (generating the demo
    images, for one); the CLI shows those lines on stderr, so ``--json`` keeps stdout one document."""
    logger = logging.getLogger("dlstore")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        logger.addHandler(_StderrHandler())
    logger.setLevel(logging.INFO)
