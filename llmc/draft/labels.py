"""What a draft's training label may hold besides a draft-vocabulary index."""
OUT_OF_VOCAB = -1  # a token the draft cannot guess: EAGLE learns its feature, not the token
NOT_LEARNED = -100  # a prompt token, or a position past the answer's end: nothing learns to guess it
