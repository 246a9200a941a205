"""The ``dlstore`` command line. Each command validates options, calls one library function and
renders its result; library errors become click errors in one place (``DlstoreGroup.invoke``)."""

from __future__ import annotations

from typing import Any

import click

from dlstore.errors import DlstoreError


class DlstoreGroup(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except DlstoreError as e:
            error = click.ClickException(str(e))
            error.exit_code = getattr(e, "exit_code", 1)
            raise error from e
        except KeyboardInterrupt:  # the shell's code for Ctrl-C (click's own Abort exits 1)
            click.echo("interrupted", err=True)
            raise click.exceptions.Exit(130) from None


@click.group(cls=DlstoreGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dlstore")
def main() -> None:
    """Find and remove the input bottleneck of PyTorch image training."""
    from dlstore.cli.render import show_library_log

    show_library_log()  # progress of long library steps (the demo images' generation) on stderr


def _register() -> None:
    from dlstore.cli.bench_cmd import bench_cmd
    from dlstore.cli.convert_cmd import convert_cmd
    from dlstore.cli.info_cmd import info_cmd, verify_cmd

    main.add_command(convert_cmd)
    main.add_command(info_cmd)
    main.add_command(verify_cmd)
    main.add_command(bench_cmd)
    main.add_command(__import__("dlstore.cli.watch_cmd", fromlist=["watch_cmd"]).watch_cmd)


_register()
