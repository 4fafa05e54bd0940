"""ROUGE as rouge-score computes it (stemmed, F-measure x 100, no bootstrap), and the extractive baselines beside
it. `rougeLsum` reads sentences as lines, so both texts are split into sentences at `.`, `!` or `?` followed by
white space before scoring it (docs/evaluation.md).
"""

import re

from rouge_score import rouge_scorer

from configs.evaluation import METRIC_KEYS

ROUGE_KEYS = METRIC_KEYS["rouge"]
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_SCORER = rouge_scorer.RougeScorer(list(ROUGE_KEYS), use_stemmer=True)


def sentence_lines(text: str) -> str:
    """One sentence per line, the form rougeLsum reads."""
    return "\n".join(part for part in _SENTENCE_END.split(text.strip()) if part)


def rouge_scores(reference: str, prediction: str) -> dict[str, float]:
    """{rouge1, rouge2, rougeL, rougeLsum}: F-measure x 100 of one prediction against its reference."""
    plain = _SCORER.score(reference, prediction)
    by_sentence = _SCORER.score(sentence_lines(reference), sentence_lines(prediction))
    scores = {key: plain[key].fmeasure * 100 for key in ("rouge1", "rouge2", "rougeL")}
    scores["rougeLsum"] = by_sentence["rougeLsum"].fmeasure * 100
    return scores


def lead_steps(article: str, clean) -> str:
    """The first sentence of each line of an article (a WikiHow step, a dialogue's turn), cleaned like a
    summary."""
    firsts = [_SENTENCE_END.split(line.strip())[0] for line in article.splitlines() if line.strip()]
    return clean(" ".join(firsts))


def lead_sentences(article: str, clean, n: int = 3) -> str:
    """The article's first n sentences, cleaned (lead-3)."""
    return " ".join(_SENTENCE_END.split(clean(article))[:n])
