"""``dlstore info`` and ``dlstore verify``."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click

from dlstore.cli.render import StorePath, emit_json, storage_options_option
from dlstore.cli.shared_options import json_option
from dlstore.write.sizes import count, human_bytes


@click.command("info")
@click.argument("dest", type=StorePath())
@json_option("Print the spec as one JSON document.")
@storage_options_option()
def info_cmd(dest: Path | str, as_json: bool, storage_options: dict[str, Any] | None) -> None:
    """Show what the cache at DEST (a folder or a URL) holds."""
    from dlstore.storage.mirror import bytes_at, spec_at

    spec = spec_at(dest, storage_options)
    nbytes = bytes_at(dest, storage_options)
    if as_json:
        emit_json({**asdict(spec), "checksums": len(spec.checksums), "bytes_on_disk": nbytes})
        return
    h, w, c = spec.shape
    click.echo(
        f"{dest}: dlstore {spec.format} cache (spec v{spec.spec_version}, dlstore {spec.dlstore_version})"
    )
    click.echo(
        f"  images    {spec.n:,} of "
        + (f"shorter side {h} (sizes vary), {c} channel(s)" if spec.ragged else f"{h}x{w}x{c}")
        + " uint8"
        + (f" ({spec.n_stored - spec.n} skipped at conversion)" if spec.n_stored != spec.n else "")
    )
    click.echo(
        f"  classes   {count(len(spec.classes), 'class', 'classes')}: {', '.join(spec.classes[:10])}{' ...' if len(spec.classes) > 10 else ''}"
    )
    click.echo(
        f"  resize    {spec.image.resize} to {spec.image.size}, pixels={spec.image.pixels} "
        + (
            "(ImageFolder's loader: convert('RGB'), alpha dropped, no EXIF rotation)"
            if spec.image.pixels == "torchvision"
            else f"(exif_transpose={spec.image.exif_transpose}, alpha on {spec.image.background})"
        )
    )
    click.echo(f"  options   {json.dumps({**spec.writer_options, **spec.format_options})}")
    if spec.fields:  # named per-sample fields (docs/fields.md)
        described = [
            f"{k} ({f.kind} {f.dtype}{'' if not f.dropped else f', {f.dropped} dropped'})"
            for k, f in spec.fields.items()
        ]
        click.echo(f"  fields    {', '.join(described)}")
    click.echo(f"  source    {spec.source.get('description')} ({spec.source.get('count')} samples)")
    click.echo(f"  on disk   {human_bytes(nbytes)} in {count(len(spec.checksums), 'file')}")


@click.command("verify", short_help="Check the cache at DEST against its checksums and source.")
@click.argument("dest", type=StorePath())
@click.option(
    "--deep", is_flag=True, help="Also re-hash every source file (catches edits that kept size and mtime)."
)
@click.option(
    "--source",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    default=None,
    help="Where the source folder is now, if it moved since conversion.",
)
@storage_options_option()
def verify_cmd(
    dest: Path | str, deep: bool, source: Path | None, storage_options: dict[str, Any] | None
) -> None:
    """Recompute checksums of the cache at DEST and check its source; exit 1 naming the first problem."""
    from dlstore.write.verification import verify

    result = verify(dest, deep=deep, source=source, storage_options=storage_options)
    for note in result.notes:
        click.echo(f"note: {note}", err=True)
    if not result.ok:
        raise click.ClickException(
            f"{result.first_problem} ({len(result.problems)} problem(s)); "
            "rebuild with `dlstore convert ... --overwrite`"
        )
    click.echo(
        f"{dest}: ok, {count(result.checked, 'file')} match their checksums"
        + (f", {result.sources_hashed} source files match by content" if deep else "")
    )
