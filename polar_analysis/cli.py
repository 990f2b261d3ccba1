"""The `polar` command line (placeholder while the foundation lands)."""
import typer

app = typer.Typer(no_args_is_help=True)


@app.command()
def version() -> None:
    print("polar 0.1.0")
