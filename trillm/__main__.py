"""`python -m trillm`: the command line (trillm.launch.cli)."""
from trillm.launch.cli import main

if __name__ == "__main__":
    main()
