"""Special-token ids shared by every SentencePiece model mmadapt trains (see data.train_tokenizer)."""

PAD_ID = 0
UNK_ID = 1
BOS_ID = 2  # <s>, starts every block (RoBERTa's CLS position)
EOS_ID = 3  # </s>, ends a block and separates documents inside one
MASK_ID = 4  # <mask>, a control piece (user-defined in tokenizers trained before 2026-12-04)
NUM_SPECIAL = 5
IGNORE_INDEX = -100  # label of a position the MLM loss skips
