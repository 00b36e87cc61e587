from services.gateway.app import main

main()
