"""python -m train RECIPE.yaml [key=value ...] — train a target (kind: target) or a drafter (kind: drafter)."""
from __future__ import annotations

import json
import logging
import sys

from dspark.config import RECIPES, RecipeError, describe, load_recipe

USAGE = """usage: python -m train RECIPE.yaml [key=value ...]

Trains what the recipe's `kind` says and writes <output_dir>/final/. Dotted overrides replace recipe fields,
e.g. `output_dir=/tmp/x max_steps=30 optim.lr=1e-3 resume=true`.
"""


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        for kind, cls in RECIPES.items():
            print(f"kind: {kind} — recipe fields:")
            print("\n".join(describe(cls)))
            print()
        return 0
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        recipe = load_recipe(argv[0], argv[1:])
        if recipe.kind == "target":
            from train.target import train_target

            summary = train_target(recipe)
        elif recipe.kind == "drafter":
            from train.drafter import train_drafter

            summary = train_drafter(recipe)
        else:  # pragma: no cover - every kind is dispatched above
            raise RecipeError(f"kind: {recipe.kind!r} has no trainer")
    except (RecipeError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: v for k, v in summary.items() if k != "history"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
