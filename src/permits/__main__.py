from permits.cli import main

main()
