"""A census-style CSV (string categoricals, raw 64-bit user ids, text labels) for the example
``conf/train/census.yaml``: learnable, deterministic, generated -- nothing is downloaded.

``python -m tests.support.census data/census`` writes ``train.csv`` and ``eval.csv`` there.
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

HEADER = "age,workclass,education,hours_per_week,occupation,capital_gain,native_country,user_id,income"
WORKCLASS = ["Private", "Self-emp-not-inc", "Local-gov", "State-gov", "Federal-gov", "?"]
EDUCATION = ["HS-grad", "Some-college", "Bachelors", "Masters", "Doctorate", "11th", "Assoc-voc"]
OCCUPATION = ["Exec-managerial", "Prof-specialty", "Craft-repair", "Sales", "Adm-clerical", "Other-service"]
COUNTRY = ["United-States", "Mexico", "Philippines", "Germany", "India", "Canada"]
_EDU = {"HS-grad": -0.6, "Some-college": -0.3, "Bachelors": 0.6, "Masters": 1.1, "Doctorate": 1.5, "11th": -1.4,
        "Assoc-voc": -0.1}
_OCC = {"Exec-managerial": 0.9, "Prof-specialty": 0.8, "Craft-repair": -0.2, "Sales": 0.0, "Adm-clerical": -0.5,
        "Other-service": -1.2}


def rows(n: int, *, seed: int, users: int = 400) -> list[str]:
    rng = random.Random(seed)
    ids = random.Random(1234)  # the same users (raw 64-bit ids, some above 2**62) in every file
    user_ids = [ids.getrandbits(63) for _ in range(users)]
    user_bias = {u: ids.gauss(0, 1.0) for u in user_ids}
    out = []
    for _ in range(n):
        age = rng.randint(17, 80)
        edu, occ = rng.choice(EDUCATION), rng.choice(OCCUPATION)
        hours = max(1, min(99, int(rng.gauss(40, 12))))
        gain = int(rng.expovariate(1 / 2000)) if rng.random() < 0.2 else 0
        user = user_ids[min(int(rng.paretovariate(1.2)) - 1, users - 1)]
        z = (_EDU[edu] + _OCC[occ] + 0.04 * (hours - 40) + 0.03 * (age - 40) - 0.0015 * (age - 45) ** 2
             + 0.0002 * gain + user_bias[user] - 0.8)
        label = ">50K" if rng.random() < 1 / (1 + math.exp(-2 * z)) else "<=50K"
        out.append(f"{age},{rng.choice(WORKCLASS)},{edu},{hours},{occ},{gain},{rng.choice(COUNTRY)},{user},{label}")
    return out


def write(folder: str | Path, *, train_rows: int = 6000, eval_rows: int = 1501) -> tuple[Path, Path]:
    """``train.csv`` and ``eval.csv`` under ``folder``; returns their paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = folder / "train.csv", folder / "eval.csv"
    for path, n, seed in ((paths[0], train_rows, 0), (paths[1], eval_rows, 1)):
        path.write_text(HEADER + "\n" + "\n".join(rows(n, seed=seed)) + "\n")
    return paths


if __name__ == "__main__":
    for p in write(sys.argv[1] if len(sys.argv) > 1 else "data/census"):
        print(p)
