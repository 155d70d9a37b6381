"""`python -m hyla ...`: the `hyla` command (hyla.cli), for environments without the script installed."""

from hyla.cli import main

if __name__ == "__main__":
    main()
