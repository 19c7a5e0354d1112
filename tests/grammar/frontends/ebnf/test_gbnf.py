"""GBNF front end: llama.cpp's example grammars, error locations, and printing round trips."""

from __future__ import annotations

import pytest
from shared_data import SHARED_DATA, require_shared_data

from agent_infer.errors import GrammarDefinitionError, GrammarSyntaxError
from agent_infer.grammar.frontends.ebnf.gbnf import parse_gbnf
from agent_infer.grammar.ir import (
    Alt,
    CharClass,
    Empty,
    Grammar,
    Literal,
    Ref,
    Repeat,
    Seq,
    alt,
    chars,
    lit,
    opt,
    plus,
    seq,
    star,
)
from agent_infer.grammar.ir.recognizer import ReferenceRecognizer

GBNF_DIR = SHARED_DATA / "gbnf"


@pytest.fixture
def _gbnf_data() -> None:
    require_shared_data("gbnf")


needs_data = pytest.mark.usefixtures("_gbnf_data")

# file -> (accepted, rejected) hand-written examples of each language
EXAMPLES: dict[str, tuple[list[str], list[str]]] = {
    "arithmetic.gbnf": (["1+2= 3\n", "x1 *(y -2)= 42\n", "a=b\nc= d\n"], ["1+2=3", "1+=2\n", "=1\n"]),
    "c.gbnf": (
        [
            "int main(){return 0;}",
            "int f(int x){x = x*2;while(x<10){x = x+1;}return x;}",
            "float g(){// hi\n/* multi */}",
        ],
        ["int main(){return 0}", "main(){}", "int f(int x)"],
    ),
    "chess.gbnf": (
        ["1. e4 e5\n2. Nf3 Nc6\n", "1. d4 d5\n2. c4 dxc4\n3. e4 O-O-O\n", "1. e4 e5\n12. Qxf7# a1=Q\n"],
        ["1. e4 e5\n", "1. e9 e5\n2. Nf3 Nc6\n", "2. e4 e5\n2. Nf3 Nc6\n"],
    ),
    "english.gbnf": (["Hello, world!", "one two\tthree"], ["", "two  spaces", "café"]),
    "japanese.gbnf": (["こんにちは", "カタカナ 漢字、"], ["", "hello"]),
    "json.gbnf": (
        ['{"a": 1}', '{"key": [1, 2.5, true, null, "x\\n"], "o": {}}', "{}"],
        ["[1, 2]", '{"a" 1}', "{'a': 1}", '{"a": 01x}'],
    ),
    "json_arr.gbnf": (["[\n1,\n2]", '[\n{"a": "b"},\n[]]', "[\n]"], ["[1,2]", "{}", "[\n1,\n]"]),
    "list.gbnf": (["- milk\n- eggs\n", "- one item\n"], ["", "- \n", "* x\n", "- a"]),
    "vllm-sql.gbnf": (
        ["SELECTcol_1fromtable_1wherecol_2=1", "SELECTcol_2fromtable_2wherecol_1=2"],
        ["SELECT col_1 from table_1 where col_2=1", "SELECTcol_3fromtable_1wherecol_2=1"],
    ),
}


@needs_data
def test_every_shared_file_has_examples() -> None:
    assert sorted(p.name for p in GBNF_DIR.glob("*.gbnf")) == sorted(EXAMPLES)


@needs_data
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_shared_grammar_accepts_its_language(name: str) -> None:
    grammar = parse_gbnf((GBNF_DIR / name).read_text(encoding="utf-8"))
    rec = ReferenceRecognizer(grammar)
    accepted, rejected = EXAMPLES[name]
    for text in accepted:
        assert rec.accepts(text), (name, text)
    for text in rejected:
        assert not rec.accepts(text), (name, text)


@needs_data
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_shared_grammar_printing_is_stable(name: str) -> None:
    grammar = parse_gbnf((GBNF_DIR / name).read_text(encoding="utf-8"))
    again = parse_gbnf(str(grammar))
    assert again == grammar
    assert str(again) == str(grammar)


def test_layout_rules_follow_llama_cpp() -> None:
    text = 'root ::=\n  "a" |\n  ( "b"\n    "c" ) # comment\nother ::= | "x"\n'
    grammar = parse_gbnf(text)
    assert grammar.rule("root") == Alt((Literal("a"), Seq((Literal("b"), Literal("c")))))
    assert grammar.rule("other") == Alt((Empty(), Literal("x")))
    assert parse_gbnf('root ::= "ab"* x{2,} x{0,3} x{4}\nx_1 ::= .\nx ::= x_1\n').rule("root") == Seq(
        (Repeat(Literal("ab")), Repeat(Ref("x"), 2), Repeat(Ref("x"), 0, 3), Repeat(Ref("x"), 4, 4))
    )


def test_escapes_in_literals_and_classes() -> None:
    g = parse_gbnf(r'root ::= "\n\r\t\\\"\x41\u00e9\U0001F600" [\]\-\[a-c^] [^\x00-\x1F]' + "\n")
    items = g.rule("root")
    assert isinstance(items, Seq)
    assert items.items[0] == Literal('\n\r\t\\"Aé\U0001f600')
    assert items.items[1] == CharClass(((0x5D, 0x5D), (0x2D, 0x2D), (0x5B, 0x5B), (0x61, 0x63), (0x5E, 0x5E)))
    assert items.items[2] == CharClass(((0, 0x1F),), negated=True)


@pytest.mark.parametrize(
    ("text", "line", "column"),
    [
        ('root ::= "abc\n', 1, 10),
        ("root ::= [a-z\n", 1, 10),
        ('root ::= ( "a"\n', 1, 10),
        ('root = "a"\n', 1, 6),
        ('root ::= "a" )\n', 1, 14),
        ("root ::= *\n", 1, 10),
        ('root ::= "a"\nnext ::= "\\q"\n', 2, 11),
        ('root ::= "a"\n  | "b"\n', 2, 3),
        ('root ::= x{2,1}\nx ::= "a"\n', 1, 11),
        ("root ::= [z-a]\n", 1, 13),
    ],
)
def test_syntax_errors_carry_line_and_column(text: str, line: int, column: int) -> None:
    with pytest.raises(GrammarSyntaxError) as info:
        parse_gbnf(text)
    assert (info.value.line, info.value.column) == (line, column)


def test_definition_errors_name_rule_and_line() -> None:
    with pytest.raises(GrammarDefinitionError, match=r"'missing'.*line 2"):
        parse_gbnf('root ::= a\na ::= "x" missing\n')
    with pytest.raises(GrammarDefinitionError, match="defined twice"):
        parse_gbnf('root ::= "a"\nroot ::= "b"\n')
    with pytest.raises(GrammarDefinitionError, match="start rule 'root'"):
        parse_gbnf('start ::= "a"\n')
    assert parse_gbnf('start ::= "a"\n', start="start").root == "start"


BUILT = [
    Grammar.from_rules(
        {
            "root": seq(lit("say "), alt(Ref("word"), Ref("num")), opt(lit("!"))),
            "word": plus(chars("a-zA-Z_")),
            "num": seq(opt(lit("-")), Repeat(chars("0-9"), 1, 3)),
        }
    ),
    Grammar.from_rules(
        {
            "root": alt(seq(Ref("root"), lit("+"), Ref("t")), Ref("t"), Empty()),
            "t": seq(star(seq(lit("a"), lit("b"))), Repeat(star(lit("c")), 0, 2), Alt(())),
        }
    ),
    Grammar.from_expr(
        seq(
            lit('quote " back \\ nl \n tab \t ctl \x01 del \x7f uni é \u2028 astral \U0001f600'),
            CharClass(
                ((0x5D, 0x5D), (0x2D, 0x2D), (0x5E, 0x5E), (0x5B, 0x5B), (0x5C, 0x5C), (0, 0x1F)), True
            ),
            CharClass(((0, 0x10FFFF),)),
            CharClass(()),
            alt(seq(lit("x"), alt(lit("y"), Empty())), Repeat(alt(lit("p"), lit("q")), 2, None)),
        )
    ),
]


@pytest.mark.parametrize("grammar", BUILT, ids=["simple", "left-recursive", "escapes"])
def test_round_trip_of_built_grammars(grammar: Grammar) -> None:
    assert parse_gbnf(str(grammar)) == grammar
