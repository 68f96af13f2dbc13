"""`python -m blockscope` runs the same Typer app as the `blockscope` script."""

from blockscope.cli import main

if __name__ == "__main__":
    main()
