"""A tiny tokenizer.json built with the `tokenizers` API, for tokenizer and generate tests."""

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

# Word-level vocabulary: ids 0..2 are special (<unk>, <s> = BOS, </s> = EOS).
WORDS = ["<unk>", "<s>", "</s>", "once", "upon", "a", "time", "cat"]


def write_tokenizer_json(path):
  """Writes a word-level tokenizer.json to `path`: whitespace split, BOS prepended on
  encode, words joined by spaces on decode."""
  tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)},
                                              unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.decoder = decoders.WordPiece()   # joins words with spaces
  tok.add_special_tokens(["<unk>", "<s>", "</s>"])
  tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
  tok.save(str(path))
