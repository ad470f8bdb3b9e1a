"""Test support shipped with tract: the non-coherent memory simulator
(`tract.testing.incoherent`), the mutation harness (`tract.testing.mutants`)
and the reference message-passing protocol they are proven on
(`tract.testing.mailbox`)."""
