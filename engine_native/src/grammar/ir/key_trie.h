// Key tries ("any key but these names") built natively (grammar/ir/key_trie.cpp); registered from
// register_grammar_serialize, whose serializer writes the programs of their nodes.
#pragma once

#include <nanobind/nanobind.h>

namespace agent_infer {
// KeyTrieBuilder, clear_key_tries, key_trie_nodes.
void register_grammar_key_trie(nanobind::module_& m);
}  // namespace agent_infer
