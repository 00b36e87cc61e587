from services.router.cli import main

main()
