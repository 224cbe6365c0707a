"""What a campaign keeps on disk and reads back."""
