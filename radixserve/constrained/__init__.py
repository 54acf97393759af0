"""Constrained decoding: JSON schema, regex, EBNF and structural tags through xgrammar.

    SamplingParams.constraint() -> GrammarSpec          which grammar a request asks for (one at most)
    GrammarSpec.check()                                 syntax check where requests are normalised (400s)
    XGrammarBackend.compile_async(spec) -> Future       compiled once per distinct spec (LRU), in a worker thread
    GrammarQueue (scheduler)                            requests wait here until their grammar is ready
    Grammar (per request)                               accept / rollback / fill its row of the batch bitmask
    fill_vocab_mask(grammars) -> bitmask [bs, V/32]     built for the batch; the sampler applies it
"""
