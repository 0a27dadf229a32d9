"""The chapters' "Check yourself" questions: each has a worked answer for instructors
(instructor/chapter_answers/), and each whose answer is a number has a check students run,
kvlab.your_turn.answer (the tables in kvlab/questions/)."""
import re
from pathlib import Path

import pytest

from kvlab import your_turn
from kvlab.questions import CHAPTERS, numbers

REPO = Path(__file__).resolve().parents[1]
ANSWERS = REPO / "instructor" / "chapter_answers"


def questions(chapter):
    """The numbers of the questions in the chapter's "Check yourself" list."""
    text = (REPO / "chapters" / f"{chapter}.md").read_text()
    section = re.search(r"^## Check yourself\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert section, f"{chapter}.md has no 'Check yourself' section"
    found = [int(n) for n in re.findall(r"^(\d+)\. ", section[1], re.M)]
    assert found == list(range(1, len(found) + 1)), f"{chapter}: questions numbered {found}"
    return found


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_question_has_a_worked_answer(chapter):
    path = ANSWERS / f"{chapter}.md"
    assert path.is_file(), f"no worked answers for {chapter} in instructor/chapter_answers/"
    answered = [int(n) for n in re.findall(r"^## (\d+)\.?\s", path.read_text(), re.M)]
    assert answered == questions(chapter), \
        f"{path.name} answers questions {answered}; the chapter asks {questions(chapter)}"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_number_questions_are_questions_of_the_chapter(chapter):
    asked = set(questions(chapter))
    table = numbers(chapter)
    assert set(table) <= asked, f"{chapter}: number checks for questions it does not ask"
    text = (REPO / "chapters" / f"{chapter}.md").read_text()
    if table:   # students are told how to check themselves
        assert f'your_turn.answer("{chapter}"' in text, \
            f"{chapter} does not show how to check an answer with your_turn.answer"


def number_questions():
    return [(chapter, n) for chapter in CHAPTERS for n in sorted(numbers(chapter))]


@pytest.mark.parametrize("chapter,question", number_questions())
def test_the_check_accepts_the_answer_and_refuses_a_wrong_one(chapter, question, capsys):
    wanted = numbers(chapter)[question]
    expected = float(wanted.expected())
    assert expected == expected and expected != 0, f"{chapter} {question}: works out {expected}"
    assert your_turn.answer(chapter, question, expected)
    if wanted.whole:            # a count: close is not enough, it must be a whole number
        assert expected.is_integer(), f"{chapter} {question}: a count of {expected}"
        assert not your_turn.answer(chapter, question, expected + 0.2)
    else:
        assert your_turn.answer(chapter, question, expected * (1 + wanted.rel_tol / 2))
    assert not your_turn.answer(chapter, question, expected * 2)
    assert not your_turn.answer(chapter, question, "a lot")
    assert not your_turn.answer(chapter, question, float("nan"))
    assert not your_turn.answer(chapter, question, True)      # a truth value is no number
    out = capsys.readouterr().out
    assert "✓ correct" in out and "not yet" in out
    assert ("a whole number; got" in out) == wanted.whole


def test_there_are_number_questions():
    assert len(number_questions()) >= 9


def test_a_question_that_is_not_asked_is_a_clear_error():
    with pytest.raises(ValueError, match="no chapter"):
        your_turn.answer("10_nothing", 1, 1.0)
    with pytest.raises(ValueError, match="no number question"):
        your_turn.answer("02_cache_size", 99, 1.0)
