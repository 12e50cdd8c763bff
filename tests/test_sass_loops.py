"""scripts/sass_loops.py: a kernel's loops in cuobjdump's SASS text, loads and MMAs in issue order."""
import pytest

# The shape of cuobjdump -sass output: two functions, the second with a loop at 0x0020-0x0080
# (a backward branch) and a forward branch out of it that is no loop.
SASS = """
        code for sm_90a
                Function : _Z5otherv
        /*0000*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0010*/                   BRA 0x0 ;
                Function : _Z6decodeILi1EEvv
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   MOV R2, RZ ;
        /*0020*/                   LDG.E.128.CONSTANT R4, desc[UR4][R2.64] ;
        /*0030*/                   LDG.E.CONSTANT R8, desc[UR4][R2.64+0x10] ;
        /*0040*/                   LOP3.LUT R9, R4, 0xf0f0f0f, RZ, 0xc0, !PT ;
        /*0050*/                   IMAD R9, R9, R8, RZ ;
        /*0060*/               @P0 LDL R10, [R1+0x8] ;
        /*0070*/                   IMMA.16832.S8.S8 R12, R4.ROW, R9.COL, R12 ;
        /*0080*/               @P1 BRA 0x20 ;
        /*0090*/                   BRA 0xb0 ;
        /*00a0*/                   STL [R1], R12 ;
        /*00b0*/                   EXIT ;
"""


def test_one_loop_its_counts_and_body(repo_module, tmp_path, capsys):
    tool = repo_module("scripts/sass_loops.py")
    instrs = tool.function_instructions(SASS, r"decodeILi1E")
    assert [a for a, _ in instrs][:3] == [0x0, 0x10, 0x20] and len(instrs) == 12
    (loop,) = tool.loops(instrs)
    assert (loop["first"], loop["last"], loop["instructions"]) == (2, 8, 7)
    assert (loop["ldg128"], loop["ldg"], loop["mma"], loop["local"]) == (1, 2, 1, 1)
    assert loop["body"] == "Wg(2)LM|"
    path = tmp_path / "k.sass"
    path.write_text(SASS)
    assert tool.main([str(path), "decodeILi1E"]) == 0
    assert "loop 2-8 (7 instructions): LDG.128 1, LDG 2, MMA 1, local 1" in capsys.readouterr().out


def test_the_first_matching_function_only_and_a_missing_one_is_named(repo_module):
    tool = repo_module("scripts/sass_loops.py")
    assert len(tool.function_instructions(SASS, r"_Z5other")) == 2
    with pytest.raises(SystemExit, match="no function matching 'nope'"):
        tool.function_instructions(SASS, "nope")
