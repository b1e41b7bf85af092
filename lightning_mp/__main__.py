"""`python -m lightning_mp fit --config configs/bert.yaml`"""

from lightning_mp.cli import main

if __name__ == "__main__":
    main()
