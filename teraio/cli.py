"""The `teraio` command line. One module per command; heavy imports happen inside them."""

from __future__ import annotations

import typer

from teraio import cmd_clean, cmd_inspect, cmd_plan, cmd_profile, cmd_roofline, cmd_run

__all__ = ["app", "main"]

app = typer.Typer(
    name="teraio",
    help="Train models larger than accelerator memory: profile a training script, plan "
    "which tensors go to SSD or host memory and when, and run the script with that plan.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
_SCRIPT = {"allow_extra_args": True, "ignore_unknown_options": False}

app.command("profile", context_settings=_SCRIPT)(cmd_profile.profile)
app.command("inspect")(cmd_inspect.inspect)
app.command("run", context_settings=_SCRIPT)(cmd_run.run)
app.command("plan")(cmd_plan.plan)
app.command("roofline")(cmd_roofline.roofline)
app.command("clean")(cmd_clean.clean)


def main() -> None:
    app()
