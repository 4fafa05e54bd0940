"""Regenerate the embedded offline assets in ``data/``: a WikiHow-format sample and a tiny T5.

    python scripts/make_embedded_assets.py [--out_dir data]

Writes, under ``--out_dir`` (default: the repository's ``data/`` folder, whatever the current directory):

* ``sample/wikihowAll.csv`` -- synthetic articles in the real file's format (header ``headline,title,text``;
  text sections joined by ``;\\n,``; headline lines joined by ``.,\\n`` after a leading ``\\n``), plus a few
  rows with the real file's quirks that the loader must drop;
* ``sample/all_{train,val,test}.txt`` -- the split lists: one title per line, spaces removed;
* ``tiny-t5/`` -- a randomly initialised, t5-small-shaped but tiny ``T5ForConditionalGeneration``
  (safetensors) with its own sentencepiece vocabulary trained on the sample (``spiece.model`` plus the
  transformers tokenizer files).

Everything is seeded: running the script twice gives byte-identical CSV, split lists and sentencepiece
model, and identical model weights (tests/test_embedded_assets.py checks the committed copies against a
fresh run). Both assets are built in a temporary folder inside ``--out_dir`` and moved into place at the end,
so a crash never leaves half an asset behind.

Each headline line is the step's first sentence cut down to its verb and object ("Fill the old watering can
with cool water." -> "Fill the watering can."), so a small model can learn the mapping within two epochs.
"""

from __future__ import annotations

import argparse
import csv
import io
import random
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs.paths import REPO_ROOT  # noqa: E402

DEFAULT_OUT_DIR = REPO_ROOT / "data"

SEED = 20240607
# Normal articles per split; the tutorial reads 1500 train and 300 validation rows.
SPLIT_SIZES = {"train": 1600, "val": 320, "test": 320}
TEXT_MIN_CHARS, TEXT_MAX_CHARS = 150, 450
MAX_HEADLINE_RATIO = 0.6  # the loader keeps a row only if len(headline) < 0.75 * len(text)

# The sample supports at most ~1090 unigram pieces; shrinking the word lists below can make 1000 too many.
SP_VOCAB_SIZE = 1000
NUM_EXTRA_IDS = 100  # T5's <extra_id_*> sentinels, appended after the sentencepiece pieces
MODEL_MAX_LENGTH = 512

TINY_T5 = {
    "d_model": 64,
    "d_kv": 16,
    "num_heads": 4,
    "d_ff": 256,
    "num_layers": 2,
    "num_decoder_layers": 2,
    "feed_forward_proj": "relu",
    "tie_word_embeddings": True,
    "dropout_rate": 0.1,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "decoder_start_token_id": 0,
}


# --------------------------------------------------------------------------------------------------------
# Word lists. One topic per kind of article: what the title is about and what its steps do.
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Topic:
    title_verbs: tuple[str, ...]
    subjects: tuple[str, ...]  # title case, as in the title
    step_verbs: tuple[str, ...]
    objects: tuple[str, ...]
    phrases: tuple[str, ...]  # what follows "<Verb> the [adjective] <object>"


def _words(spec: str) -> tuple[str, ...]:
    """'a|b c|d' -> ('a', 'b c', 'd'): keeps the word lists compact."""
    return tuple(spec.split("|"))


TOPICS = (
    Topic(
        title_verbs=_words("Water|Repot|Prune|Fertilize|Grow|Propagate|Revive"),
        subjects=_words(
            "Fern|Cactus|Orchid|Basil Plant|Tomato Plant|Bonsai Tree|Rose Bush|Succulent|Ivy Plant"
            "|Lavender Bush|Spider Plant|Lemon Tree"
        ),
        step_verbs=_words("Fill|Pour|Check|Trim|Loosen|Lift|Place|Mist|Rinse|Move"),
        objects=_words(
            "watering can|pot|soil|roots|leaves|stems|saucer|drainage tray|fertilizer|pruning shears|seedlings"
            "|mulch"
        ),
        phrases=_words(
            "with cool water|near a sunny window|around the base|every few days|before the soil dries out"
            "|over the sink|once a week|in early spring|with your fingers|so the roots can breathe"
        ),
    ),
    Topic(
        title_verbs=_words("Clean|Polish|Dust|Deodorize|Wash|Disinfect|Descale"),
        subjects=_words(
            "Oven|Bathtub|Window|Microwave|Carpet|Sink|Refrigerator|Mirror|Stovetop|Shower Curtain|Kettle"
            "|Dishwasher"
        ),
        step_verbs=_words("Spray|Wipe|Scrub|Rinse|Dry|Mix|Soak|Sprinkle|Remove|Open"),
        objects=_words("sponge|cloth|baking soda|vinegar|bucket|brush|towel|gloves|cleaner|surface|stains|racks"),
        phrases=_words(
            "with warm soapy water|in small circles|from top to bottom|for ten minutes|until it shines"
            "|with a damp rag|before you start|along the edges|in a well aired room|after every use"
        ),
    ),
    Topic(
        title_verbs=_words("Bake|Cook|Grill|Roast|Make|Season|Reheat"),
        subjects=_words(
            "Bread Loaf|Pancake|Omelet|Salmon Fillet|Pizza|Rice Dish|Soup|Muffin|Chicken Breast|Pie|Potato|Steak"
        ),
        step_verbs=_words("Preheat|Whisk|Chop|Stir|Heat|Pour|Slice|Season|Knead|Serve"),
        objects=_words("oven|eggs|onions|batter|pan|dough|butter|flour|sauce|baking sheet|garlic|vegetables"),
        phrases=_words(
            "over medium heat|with a wooden spoon|for about five minutes|until golden brown|in a large bowl"
            "|with a pinch of salt|on a clean board|while it is still warm|until the mixture is smooth"
            "|right before serving"
        ),
    ),
    Topic(
        title_verbs=_words("Paint|Sand|Repair|Assemble|Fix|Hang|Refinish"),
        subjects=_words(
            "Chair|Bookshelf|Fence|Door|Table|Picture Frame|Drawer|Cabinet|Shelf|Bed Frame|Desk|Stool"
        ),
        step_verbs=_words("Measure|Mark|Sand|Drill|Tighten|Attach|Apply|Sweep|Cover|Check"),
        objects=_words("boards|screws|hinges|primer|paint|drop cloth|level|edges|sandpaper|corners|legs|frame"),
        phrases=_words(
            "with a pencil|along the grain|in thin coats|with a cordless drill|before the glue sets"
            "|on a flat surface|twice to be sure|with a soft brush|in a dry garage|until it feels smooth"
        ),
    ),
    Topic(
        title_verbs=_words("Wash|Iron|Fold|Mend|Dye|Store|Shrink"),
        subjects=_words(
            "Wool Sweater|Silk Shirt|Pair of Jeans|Winter Coat|Linen Dress|Leather Jacket|Scarf|Tie"
            "|Pair of Socks|Hoodie|Cotton Blanket|Hat"
        ),
        step_verbs=_words("Turn|Fill|Soak|Press|Hang|Fold|Check|Sew|Brush|Lay"),
        objects=_words("label|sink|detergent|iron|seams|collar|sleeves|hanger|button|fabric|pockets|hem"),
        phrases=_words(
            "inside out|with cold water|on a low setting|on a flat towel|with a needle and thread"
            "|away from direct heat|for half an hour|in a cool closet|along the seam|before it dries"
        ),
    ),
    Topic(
        title_verbs=_words("Groom|Feed|Train|Bathe|Walk|Calm|Adopt"),
        subjects=_words(
            "Puppy|Cat|Rabbit|Hamster|Parrot|Goldfish|Guinea Pig|Horse|Turtle|Kitten|Ferret|Older Dog"
        ),
        step_verbs=_words("Brush|Offer|Fill|Reward|Clip|Clean|Prepare|Praise|Measure|Check"),
        objects=_words("bowl|treats|leash|cage|fur|nails|food|water dish|toys|bedding|collar|carrier"),
        phrases=_words(
            "in a quiet room|every morning|with a gentle voice|after each meal|with a soft brush"
            "|at the same time each day|before a long walk|in small amounts|when your pet is calm|twice a week"
        ),
    ),
    Topic(
        title_verbs=_words("Pack|Plan|Organize|Budget|Prepare|Book|Photograph"),
        subjects=_words(
            "Road Trip|Camping Trip|Picnic|Beach Day|Birthday Party|Garage Sale|Hiking Trip|Family Dinner"
            "|Study Session|Moving Day|Garden Party|Weekend Away"
        ),
        step_verbs=_words("Write|Pack|Choose|Call|Buy|Set|Label|Load|Share|Print"),
        objects=_words("list|bags|snacks|tickets|map|budget|tent|boxes|schedule|invitations|supplies|camera"),
        phrases=_words(
            "a week ahead|on a sheet of paper|with your friends|the night before|in the trunk|by the front door"
            "|as early as possible|in a shared folder|within your budget|before you leave"
        ),
    ),
    Topic(
        title_verbs=_words("Reset|Update|Speed Up|Back Up|Set Up|Troubleshoot|Recycle"),
        subjects=_words(
            "Laptop|Router|Printer|Smartphone|Tablet|Keyboard|Monitor|Game Console|Smart Speaker|Webcam"
            "|Hard Drive|Television"
        ),
        step_verbs=_words("Unplug|Restart|Download|Install|Connect|Copy|Delete|Enable|Disable|Open"),
        objects=_words(
            "cable|settings menu|software|drivers|password|browser|files|battery|charger|network|firmware|adapter"
        ),
        phrases=_words(
            "from the official website|for thirty seconds|through the control panel|with a paperclip"
            "|on an external disk|while the device is off|using the app|in safe mode|after a fresh restart"
            "|without losing your data"
        ),
    ),
    Topic(
        title_verbs=_words("Wax|Jump Start|Detail|Inspect|Winterize|Park|Tow"),
        subjects=_words(
            "Car|Truck|Motorcycle|Minivan|Bicycle|Scooter|Camper Van|Convertible|Pickup Truck|Sedan|Golf Cart"
            "|Trailer"
        ),
        step_verbs=_words("Lift|Inflate|Replace|Drain|Inspect|Lubricate|Jack|Adjust|Wash|Secure"),
        objects=_words(
            "tires|hood|wipers|chain|brakes|mirrors|engine oil|headlights|spark plugs|jumper cables|wheel nuts"
            "|coolant"
        ),
        phrases=_words(
            "with a socket wrench|on level ground|to the recommended pressure|before a long drive"
            "|in a shaded spot|according to the manual|with a funnel|once the engine is cold|every few months"
            "|with a microfiber cloth"
        ),
    ),
    Topic(
        title_verbs=_words("Practice|Improve|Start|Master|Learn|Teach|Enjoy"),
        subjects=_words(
            "Push Up|Yoga Pose|Morning Run|Swimming Stroke|Jump Rope Routine|Plank|Squat|Stretching Routine"
            "|Tennis Serve|Basketball Shot|Golf Swing|Cartwheel"
        ),
        step_verbs=_words("Stretch|Bend|Breathe|Hold|Raise|Lower|Keep|Relax|Count|Repeat"),
        objects=_words("knees|arms|shoulders|back|core|wrists|ankles|hips|elbows|neck|breath|heels"),
        phrases=_words(
            "slowly and steadily|for a count of ten|in front of a mirror|on a yoga mat|three times"
            "|without locking your joints|at a comfortable pace|as you exhale deeply|with a coach watching"
            "|until you feel a gentle pull"
        ),
    ),
    Topic(
        title_verbs=_words("Knit|Sketch|Sculpt|Decorate|Weave|Frame|Gift Wrap"),
        subjects=_words(
            "Greeting Card|Scrapbook|Clay Mug|Candle|Quilt|Wreath|Bracelet|Journal Cover|Paper Lantern|Puppet"
            "|Mosaic|Tote Bag"
        ),
        step_verbs=_words("Cut|Glue|Draw|Trace|Shape|Thread|Color|Stamp|Wrap|Tie"),
        objects=_words("paper|ribbon|beads|yarn|stencil|clay|scissors|glitter|markers|cardboard|twine|buttons"),
        phrases=_words(
            "along the dotted line|with a hot glue gun|in bright colors|on a sheet of newspaper"
            "|around the outside|using a ruler|with steady hands|into neat strips|at the very end"
            "|so nothing slips"
        ),
    ),
    Topic(
        title_verbs=_words("Tune|Play|Restring|Record|Compose|Memorize|Clean"),
        subjects=_words(
            "Guitar|Violin|Piano Piece|Ukulele|Drum Kit|Flute|Harmonica|Cello|Banjo|Trumpet|Song|Melody"
        ),
        step_verbs=_words("Loosen|Pluck|Strum|Listen|Tap|Play|Hum|Record|Write|Polish"),
        objects=_words("strings|pegs|chords|notes|rhythm|metronome|tuner|sheet music|bow|keys|melody|scales"),
        phrases=_words(
            "with a clip on tuner|one string at a time|at a slow tempo|every single day|with a steady beat"
            "|until it sounds right|in a quiet space|before each lesson|with both hands|for twenty minutes"
        ),
    ),
    Topic(
        title_verbs=_words("Study for|Prepare for|Write|Revise|Present|Outline|Proofread"),
        subjects=_words(
            "Math Exam|History Essay|Science Project|Book Report|Spelling Test|Job Interview|Research Paper"
            "|Speech|Lab Report|Poem|Resume|Cover Letter"
        ),
        step_verbs=_words("Read|Highlight|Summarize|Review|Underline|Organize|Quiz|Rehearse|Gather|Edit"),
        objects=_words(
            "textbook|notes|flashcards|chapters|questions|paragraphs|sources|outline|draft|vocabulary|diagrams"
            "|citations"
        ),
        phrases=_words(
            "in the library|with a study partner|one section at a time|out loud|the evening before"
            "|with colored pens|during short breaks|in your own words|without looking at the answers"
            "|at your desk"
        ),
    ),
)

TITLE_ADJECTIVES = _words(
    "|Small|Large|Old|New|Favorite|Simple|Heavy|Tiny|Rustic|Modern|Classic|Delicate|Dusty|Cheap"
)
STEP_ADJECTIVES = _words("||small|clean|dry|old|large|fresh|warm|soft|sturdy|spare")
TOOLS = _words(
    "timer|notebook|flashlight|step stool|pair of gloves|measuring tape|spray bottle|small brush|old towel"
    "|helper|headlamp|magnifying glass|toolbox|clipboard|pocket knife|kneeling pad|calculator|stopwatch|ladder"
    "|wheelbarrow"
)
PLACES = _words(
    "kitchen|garage|garden|hallway|living room|backyard|laundry room|basement|attic|porch|balcony|workshop"
    "|bathroom|driveway|shed|classroom"
)
TIPS = (
    "This helps the {subject} last longer.",
    "Take your time with this step.",
    "You can use a {tool} if you have one.",
    "Do this in the {place} if possible.",
    "Wait about {minutes} minutes before moving on.",
    "Most people find this easier with a {tool}.",
    "Keep the {subject} away from children.",
    "Do not rush, or you may need to start over.",
    "Repeat this if the result looks uneven.",
    "A {tool} from the {place} works well here.",
    "Ask a friend for help if the {subject} is awkward to handle.",
    "Check the instructions that came with the {subject}.",
    "Wear old clothes, because this can get messy.",
    "Open a window for fresh air while you work.",
    "It should take no more than {minutes} minutes.",
    "If anything feels wrong, stop and try again later.",
    "Children can help with this part under supervision.",
    "Write down what you did so you remember next time.",
    "Experts recommend doing this regularly.",
    "Patience matters more than strength here.",
    "Cheap supplies work just as well as expensive ones.",
    "Clear some space in the {place} first.",
    "Keep a {tool} nearby in case you need it.",
    "Skip this step if the {subject} is brand new.",
    "Small mistakes are normal, so keep going.",
    "Good lighting makes this much easier.",
    "Store everything neatly when you finish.",
    "Your neighbors may have useful advice as well.",
    "Safety comes first, especially with sharp objects.",
    "The whole family can enjoy the result together.",
)


def _article(rng: random.Random, topic: Topic, subject: str) -> tuple[str, str]:
    """One article's (headline, text) in the real file's format; retried until the length rules hold."""
    while True:
        steps, lines = [], []
        n_steps = rng.randint(3, 5)
        for verb, obj in zip(
            rng.sample(topic.step_verbs, n_steps), rng.sample(topic.objects, n_steps), strict=True
        ):
            adjective = rng.choice(STEP_ADJECTIVES)
            noun_phrase = f"{adjective} {obj}" if adjective else obj
            sentences = [f"{verb} the {noun_phrase} {rng.choice(topic.phrases)}."]
            for _ in range(rng.choice((0, 1, 1, 2))):
                tip = rng.choice(TIPS).format(
                    subject=subject.lower(),
                    tool=rng.choice(TOOLS),
                    place=rng.choice(PLACES),
                    minutes=rng.choice((2, 5, 10, 15)),
                )
                if tip not in sentences:
                    sentences.append(tip)
            steps.append(" " + " ".join(sentences))
            lines.append(f"{verb} the {obj}")
        # Most real texts join sections with ";\n,"; some with "\n," after the section's full stop, which
        # the loader rewrites to ".\n".
        text = (";\n," if rng.random() < 0.85 else "\n,").join(steps)
        headline = "\n" + ".,\n".join(lines) + "."
        if TEXT_MIN_CHARS <= len(text) <= TEXT_MAX_CHARS and len(headline) < MAX_HEADLINE_RATIO * len(text):
            return headline, text


def _unique_titles(rng: random.Random, count: int) -> list[tuple[str, Topic, str]]:
    """`count` distinct (title, topic, subject) triples, also distinct once spaces are removed."""
    seen, out = set(), []
    while len(out) < count:
        topic = rng.choice(TOPICS)
        subject, verb, adjective = (
            rng.choice(topic.subjects),
            rng.choice(topic.title_verbs),
            rng.choice(TITLE_ADJECTIVES),
        )
        noun_phrase = f"{adjective} {subject}" if adjective else subject
        article = "an" if noun_phrase[0] in "AEIOU" else "a"
        title = f"How to {verb} {article} {noun_phrase}"
        if title.replace(" ", "") not in seen:
            seen.add(title.replace(" ", ""))
            out.append((title, topic, subject))
    return out


# Rows with the real file's quirks, each of which the loader must drop (docs/pitfalls.md #12): the split list
# that names the row's title (None: no list), and the row made from a normal (headline, title, text).
QUIRKS = (
    ("train", lambda h, t, x: [h, t, ""]),  # blank text
    ("val", lambda h, t, x: [h, t, "   "]),  # text that is blank once stripped
    ("train", lambda h, t, x: [h + h, t, x.split(";\n,")[0][:40]]),  # headline >= 0.75 * text
    ("test", lambda h, t, x: [h, t, " " + h.split(".,")[0].strip() + "."]),  # text: 1st headline line
    ("train", lambda h, t, x: [h, t]),  # 2 fields
    ("train", lambda h, t, x: [h, t, x, "extra"]),  # 4 fields
    ("train", lambda h, t, x: ["", t, x]),  # empty headline: passes the length rule, dropped after
    (None, lambda h, t, x: [h, t, x]),  # a well-formed article that is in no split list
)


def make_sample(rng: random.Random) -> tuple[list[list[str]], dict[str, list[str]]]:
    """CSV rows (without the header) and the split lists (titles with spaces removed)."""
    n_normal = sum(SPLIT_SIZES.values())
    titles = _unique_titles(rng, n_normal + len(QUIRKS))
    split_of = [name for name, size in SPLIT_SIZES.items() for _ in range(size)]
    rng.shuffle(split_of)
    makers = [(split, None) for split in split_of] + list(QUIRKS)

    rows: list[list[str]] = []
    splits: dict[str, list[str]] = {name: [] for name in SPLIT_SIZES}
    for (title, topic, subject), (split, make_row) in zip(titles, makers, strict=True):
        headline, text = _article(rng, topic, subject)
        rows.append([headline, title, text] if make_row is None else make_row(headline, title, text))
        if split is not None:
            splits[split].append(title)

    rng.shuffle(rows)  # the real file is not ordered by split
    order = {row[1]: i for i, row in enumerate(rows)}
    return rows, {name: sorted(lst, key=order.__getitem__) for name, lst in splits.items()}


def write_sample(folder: Path, rows: list[list[str]], splits: dict[str, list[str]]) -> None:
    folder.mkdir(parents=True)
    with open(folder / "wikihowAll.csv", "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(["headline", "title", "text"])
        writer.writerows(rows)
    for name, titles in splits.items():
        with open(folder / f"all_{name}.txt", "w", encoding="utf-8", newline="") as f:
            f.writelines(title.replace(" ", "") + "\n" for title in titles)


# --------------------------------------------------------------------------------------------------------
# Tokenizer and model
# --------------------------------------------------------------------------------------------------------


def train_sentencepiece(sentences: list[str]) -> bytes:
    """A T5-style unigram sentencepiece model (pad 0, eos 1, unk 2, no bos), byte-deterministic.

    Determinism: one thread, every sentence used in the given order (no sampling, no shuffling), a fixed
    random seed, and the model written to memory so the stored trainer spec names no (temporary) path.
    """
    import sentencepiece as spm

    spm.set_random_generator_seed(SEED)
    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=buffer,
        model_type="unigram",
        vocab_size=SP_VOCAB_SIZE,
        character_coverage=1.0,
        normalization_rule_name="nmt_nfkc",
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        pad_piece="<pad>",
        eos_piece="</s>",
        unk_piece="<unk>",
        num_threads=1,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        minloglevel=2,
    )
    return buffer.getvalue()


def tokenizer_corpus(rows: list[list[str]]) -> list[str]:
    """The lines of every title, headline and text, raw (with the ``;`` and ``,`` of the joins, which the
    loader keeps in the text) and as the loader cleans them."""
    corpus = []
    for row in rows:
        for field in row:
            corpus.extend(line.strip() for line in field.split("\n") if line.strip())
        if len(row) == 3:
            corpus.extend(line.strip() for line in row[0].replace(".,", ".").split("\n") if line.strip())
    return corpus


def make_tiny_t5(folder: Path, spiece_model: bytes) -> tuple[int, int]:
    """Write spiece.model, the tokenizer files and the model into `folder`; returns (vocab, params)."""
    import torch
    from transformers import T5Config, T5ForConditionalGeneration, T5Tokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    folder.mkdir(parents=True)
    (folder / "spiece.model").write_bytes(spiece_model)
    # transformers 5: T5Tokenizer(vocab_file=...) ignores the sentencepiece vocabulary; from a folder it
    # converts spiece.model (via protobuf) to a `tokenizers` tokenizer (docs/pitfalls.md #10).
    tokenizer = T5Tokenizer.from_pretrained(
        str(folder), extra_ids=NUM_EXTRA_IDS, model_max_length=MODEL_MAX_LENGTH
    )
    expected = SP_VOCAB_SIZE + NUM_EXTRA_IDS
    if len(tokenizer) != expected:
        raise RuntimeError(
            f"tokenizer has {len(tokenizer)} tokens, expected {SP_VOCAB_SIZE} pieces + "
            f"{NUM_EXTRA_IDS} extra ids = {expected}"
        )
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in ("<pad>", "</s>", "<unk>")}
    if ids != {"<pad>": 0, "</s>": 1, "<unk>": 2}:
        raise RuntimeError(f"unexpected special token ids {ids}")
    tokenizer.save_pretrained(str(folder))

    config = T5Config(vocab_size=expected, **TINY_T5)
    torch.manual_seed(SEED)
    model = T5ForConditionalGeneration(config)
    if len(tokenizer) > model.config.vocab_size:
        raise RuntimeError("tokenizer is larger than the model's vocabulary")
    model.save_pretrained(str(folder))
    return len(tokenizer), sum(p.numel() for p in model.parameters())


def _replace_dir(new: Path, target: Path) -> None:
    """Move `new` to `target`, replacing what is there; the old copy is removed only after the move."""
    old = None
    if target.exists():
        old = target.with_name(target.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        target.rename(old)
    new.rename(target)
    if old is not None:
        shutil.rmtree(old)


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out_dir",
        type=Path,
        default=DEFAULT_OUT_DIR,
        help=f"folder that receives sample/ and tiny-t5/ (default: {DEFAULT_OUT_DIR})",
    )
    args = parser.parse_args(argv)
    out_dir = args.out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)

    rng = random.Random(SEED)
    rows, splits = make_sample(rng)
    spiece_model = train_sentencepiece(tokenizer_corpus(rows))

    # Build in a temporary folder on the same filesystem, then rename into place.
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".make_embedded_assets-") as tmp:
        write_sample(Path(tmp) / "sample", rows, splits)
        vocab, n_params = make_tiny_t5(Path(tmp) / "tiny-t5", spiece_model)
        for path in Path(tmp).rglob("*"):  # safetensors writes 0600 files; make the assets world-readable
            path.chmod(0o755 if path.is_dir() else 0o644)
        _replace_dir(Path(tmp) / "sample", out_dir / "sample")
        _replace_dir(Path(tmp) / "tiny-t5", out_dir / "tiny-t5")

    n_quirks = sum(split is not None for split, _ in QUIRKS)
    print(
        f"wrote {out_dir / 'sample'} ({_size(out_dir / 'sample'):,} bytes): {len(rows)} CSV rows = "
        f"{sum(SPLIT_SIZES.values())} articles in the split lists + {n_quirks} listed rows the loader must "
        f"drop + {len(QUIRKS) - n_quirks} article in no list"
    )
    for name, titles in splits.items():
        print(f"  all_{name}.txt: {len(titles)} titles ({SPLIT_SIZES[name]} usable)")
    print(
        f"wrote {out_dir / 'tiny-t5'} ({_size(out_dir / 'tiny-t5'):,} bytes): vocabulary {vocab} "
        f"({SP_VOCAB_SIZE} sentencepiece + {NUM_EXTRA_IDS} extra ids), {n_params:,} parameters"
    )


if __name__ == "__main__":
    main()
