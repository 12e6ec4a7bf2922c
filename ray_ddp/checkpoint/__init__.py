"""What a checkpoint holds, and writing it whole or not at all (``format``); no Ray."""
