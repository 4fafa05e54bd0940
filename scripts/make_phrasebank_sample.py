"""Write a small synthetic sample in FinancialPhraseBank's original format, for the seed-001 recipe offline.

    python scripts/make_phrasebank_sample.py [--out data/financial_phrasebank/Sentences_AllAgree.txt]

The real file (FinancialPhraseBank-v1.0, `Sentences_AllAgree.txt`: 2,264 sentences from financial news on
which all annotators agreed) is one `sentence@label` per line, the label positive, negative or neutral,
encoded in Latin-1, with spaces before punctuation as its tokenisation left them. This sample has the same
format and about the same label shares (61% neutral, 25% positive, 14% negative), from word lists in which
the label follows from the verb, so a small model can learn it. It is seeded: a second run writes the same
bytes (tests/test_sources.py checks the committed copy).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs.paths import REPO_ROOT  # noqa: E402

DEFAULT_OUT = REPO_ROOT / "data" / "financial_phrasebank" / "Sentences_AllAgree.txt"
SENTENCES = 600
LABEL_SHARES = (("neutral", 0.61), ("positive", 0.25), ("negative", 0.14))

# Latin-1 letters in the names, as in the real file's Finnish and Swedish company and place names.
COMPANIES = ("Metsä Board", "Kesko", "Stockmann", "Tieto", "Ålandsbanken", "Nokian Tyres", "Fiskars", "Orion",
             "Wärtsilä", "Rapala", "Componenta", "Aspo", "Tecnomen", "Efore", "Elisa")  # fmt: skip
MEASURES = ("operating profit", "net sales", "net profit", "order intake", "revenue", "earnings per share")
RISES = ("rose", "increased", "grew", "improved", "climbed")
FALLS = ("fell", "decreased", "dropped", "declined", "slumped")
PERIODS = ("in the first quarter", "in the second quarter", "in 2009", "in the third quarter", "last year")
NEUTRAL_TEMPLATES = (
    "{company} is headquartered in {place} and employs some {people} people .",
    "The annual general meeting of {company} will be held in {place} on {day} April .",
    "{company} will publish its interim report on {day} May .",
    "The company {company} has operations in {place} and {other_place} .",
    "According to {company} , the agreement covers deliveries to {place} .",
)
PLACES = ("Helsinki", "Espoo", "Tampere", "Turku", "Oulu", "Vaasa", "Göteborg", "Malmö", "Tallinn", "Riga")


def sentence(rng: random.Random, label: str) -> str:
    company = rng.choice(COMPANIES)
    if label == "neutral":
        place, other_place = rng.sample(PLACES, 2)
        template = rng.choice(NEUTRAL_TEMPLATES)
        return template.format(company=company, place=place, other_place=other_place,
                               people=rng.randrange(50, 5000), day=rng.randrange(1, 29))  # fmt: skip
    verb = rng.choice(RISES if label == "positive" else FALLS)
    before, change = rng.randrange(5, 400), rng.randrange(1, 60)
    after = before + change if label == "positive" else max(before - change, 1)
    return (
        f"{company} 's {rng.choice(MEASURES)} {verb} to EUR {after}.{rng.randrange(10)} mn from EUR "
        f"{before}.{rng.randrange(10)} mn {rng.choice(PERIODS)} ."
    )


def make_sample(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    labels = [label for label, share in LABEL_SHARES for _ in range(round(share * SENTENCES))]
    rng.shuffle(labels)
    return [f"{sentence(rng, label)}@{label}" for label in labels]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the file to write")
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    # Latin-1 and CRLF line ends, as the original file.
    tmp.write_bytes("".join(line + "\r\n" for line in make_sample()).encode("latin-1"))
    tmp.replace(args.out)
    print(f"wrote {len(make_sample())} sentences to {args.out}")


if __name__ == "__main__":
    main()
